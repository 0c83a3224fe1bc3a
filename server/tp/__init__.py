"""A tensor-parallel server's rank processes (docs/structure.md, "Tensor parallel").

Rank 0 is the server process: HTTP, the engine thread (scheduler, KV manager bookkeeping,
sampling) and shard 0 of the model and of the KV pools. It starts ranks 1..N-1 (`group.RankGroup`,
multiprocessing "spawn") and tells them, over one authenticated ZeroMQ channel (`channel.py`,
msgspec, never pickle), every operation they must mirror on their own shards, in rank 0's order
(`messages.Op`): pool copies (offload, onboard, partial-reuse copies), forwards, and the KV
transfers' leases and pulls. Each rank runs its forward in lockstep with the others through the
torch.distributed collectives inside the model. `worker.py` is the other ranks' loop.
"""
