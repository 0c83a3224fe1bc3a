"""Rank 0's model runner of a tensor-parallel server: every step goes to the other ranks first.

It wraps the rank's own `ModelRunner` (shard 0) from outside (STYLE.md #10): `execute` queues the
step (`Forward`) after the pool copies rank 0's KV manager ran since the last one, sends them, then
runs shard 0, whose collectives meet the other ranks'. The engine sees the runner it always saw.
"""

from __future__ import annotations

import torch

from server.models.runner import ModelRunner, SeqChunk
from server.models.spec import ModelSpec
from server.tp.messages import Forward, SeqStep
from server.tp.ranks import Ranks


class RankedRunner:
    def __init__(self, runner: ModelRunner, ranks: Ranks) -> None:
        self.runner = runner
        self.ranks = ranks

    @property
    def spec(self) -> ModelSpec:
        return self.runner.spec

    @property
    def kernels(self) -> str:
        return self.runner.kernels

    def warm_up(self) -> float:
        return self.runner.warm_up()

    def execute(self, chunks: list[SeqChunk]) -> torch.Tensor:
        """Float32 logits [chunks with need_logits, vocab] (the whole vocabulary, on rank 0)."""
        self.ranks.add(Forward([SeqStep(c.token_ids, c.num_past, c.slot_tables, c.need_logits) for c in chunks]))
        self.ranks.flush()
        return self.runner.execute(chunks)
