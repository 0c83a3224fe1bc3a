"""Rank 0's model runner of a tensor-parallel server: every step goes to the other ranks first.

`execute` sends the step (`Forward`, after the pool copies since the last one), then runs shard 0,
whose collectives meet the other ranks'. A row whose token is still on the device (async
scheduling) is named by its row; rank 0 broadcasts the sampled ids right before its forward.
"""

from __future__ import annotations

import torch

from server.models.parallel import group
from server.models.runner import ModelRunner, PendingTokens, SeqChunk
from server.tp.messages import Forward
from server.tp.ranks import Ranks


def _rank0(name: str) -> property:
    """The attribute `name` of rank 0's `ModelRunner` (every rank runs and routes the same steps)."""
    return property(lambda self: getattr(self.runner, name))


class RankedRunner:
    spec = _rank0("spec")
    kernels = _rank0("kernels")
    device = _rank0("device")
    max_batch_size = _rank0("max_batch_size")
    graphs = _rank0("graphs")  # (benchmarks read them)
    expert_load = _rank0("expert_load")
    warm_up = _rank0("warm_up")  # each rank warms up in step with the others

    def __init__(self, runner: ModelRunner, ranks: Ranks) -> None:
        self.runner = runner
        self.ranks = ranks

    def execute(self, chunks: list[SeqChunk], pending: PendingTokens | None = None) -> torch.Tensor:
        """Float32 logits [chunks with need_logits, vocab] (the whole vocabulary, on rank 0)."""
        if pending is None:
            self.ranks.flush(Forward(chunks))
        else:
            source = pending.source.contiguous()
            self.ranks.flush(Forward(chunks, dict(pending.rows), source.numel()))
            group.share_from_rank0(source)
        return self.runner.execute(chunks, pending)
