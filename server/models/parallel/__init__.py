"""Tensor parallelism, applied to the plain model from outside.

`plan.py` says which heads, FFN columns and vocabulary rows a rank holds (`ShardPlan`), `shard.py`
loads only those slices from safetensors, and `context.py` holds the three places where the ranks
meet (`ParallelContext`: the vocabulary-parallel embedding, the all-reduce after each row-parallel
projection, the gathered logits) with a null object for one rank (`SingleRank`).
"""
