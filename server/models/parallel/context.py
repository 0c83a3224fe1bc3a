"""Where tensor-parallel ranks meet inside the model: three calls, and a null object for one rank.

The model calls its `ParallelContext` at three points: `embed` (token ids [T] -> the residual stream
[T, hidden], whole on every rank; vocabulary-parallel: rows this rank does not hold are zero, an
all-reduce sums the ranks'), `reduce` (the all-reduce of a row-parallel projection's partial output
[T, hidden], after o and down) and `logits` (x [N, hidden] -> [N, vocab] on every rank: each rank's
vocabulary slice of the lm_head, gathered). `SingleRank` is TP=1 and adds nothing; `TensorParallel`
runs the collectives through torch.distributed (gloo on the CPU, NCCL on CUDA, captured in the decode
CUDA graphs like any kernel).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from server.models.model_spec import ModelSpec
from server.models.moe.dispatch import AllToAllDispatch
from server.models.parallel.plan import ShardPlan
from server.models.parallel.shard import load_shard, local_spec, plan_for


class SingleRank:
    """TP=1, the null object."""

    def embed(self, token_ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, table)

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def logits(self, x: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        return F.linear(x, head)


class TensorParallel:
    """The collectives over the default torch.distributed process group."""

    def __init__(self, plan: ShardPlan) -> None:
        self.size = dist.get_world_size()
        self.vocab_start = plan.vocab[0]
        self.vocab_rows = plan.vocab_per_rank
        self.vocab_size = plan.vocab_size
        # torch 2.13 renamed all_gather_into_tensor (which still works, with a warning)
        self._gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def embed(self, token_ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        local = token_ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_rows)
        h = F.embedding(local.masked_fill(outside, 0), table)  # [T, hidden]
        return self.reduce(h.masked_fill_(outside[:, None], 0))

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; returns it."""
        dist.all_reduce(x)
        return x

    def logits(self, x: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        part = F.linear(x, head)  # [N, vocab_rows]
        n = part.shape[0]
        gathered = torch.empty((self.size * n, self.vocab_rows), dtype=part.dtype, device=part.device)
        self._gather(gathered, part.contiguous())  # rank 0's rows, then rank 1's, ...
        gathered = gathered.view(self.size, n, self.vocab_rows)
        return gathered.transpose(0, 1).reshape(n, self.size * self.vocab_rows)[:, :self.vocab_size]


ParallelContext = SingleRank | TensorParallel


@dataclass(frozen=True)
class RankShard:
    """What a ModelRunner needs to run one rank's part of the model."""

    plan: ShardPlan
    context: ParallelContext
    dispatch: AllToAllDispatch | None = None  # the MoE blocks' all-to-all (`expert_dispatch: all_to_all`)

    @classmethod
    def of(cls, spec: ModelSpec, rank: int, size: int, *, expert_parallel: bool = False,
           all_to_all: bool = False) -> RankShard:
        """`rank`'s part of the model, meeting the others through the default process group
        (`expert_parallel`: a MoE model's experts spread whole over the ranks, their tokens sent to
        them by all-to-all with `all_to_all`)."""
        plan = plan_for(spec, rank, size, expert_parallel=expert_parallel)
        dispatch = None
        if all_to_all and plan.expert_parallel:
            dispatch = AllToAllDispatch(rank, size, plan.num_experts // size)
        return cls(plan, TensorParallel(plan), dispatch)

    def local_spec(self, spec: ModelSpec) -> ModelSpec:
        return local_spec(spec, self.plan)

    def load(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device,
             quantization: str | None = None) -> dict[str, object]:
        return load_shard(spec, self.plan, dtype, device, quantization)
