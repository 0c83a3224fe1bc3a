"""Rank 0's model runner of a tensor-parallel server: every step goes to the other ranks first.

It wraps the rank's own `ModelRunner` from outside: `execute` sends the step (`Forward`, after the
pool copies since the last one), then runs shard 0, whose collectives meet the other ranks'.
Async scheduling: a row whose token is still on the device is named by its row, and rank 0
broadcasts the sampled ids right before its forward, so no host waits for them."""

from __future__ import annotations

import torch

from server.models.model_spec import ModelSpec
from server.models.parallel import group
from server.models.runner import ModelRunner, PendingTokens, SeqChunk
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

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def max_batch_size(self) -> int:
        return self.runner.max_batch_size

    @property
    def graphs(self):
        """Rank 0's decode graphs (benchmarks read them)."""
        return self.runner.graphs

    def warm_up(self) -> float:
        return self.runner.warm_up()

    @property
    def expert_load(self):
        """Rank 0's count of tokens per expert (every rank routes the same tokens the same way)."""
        return self.runner.expert_load

    def execute(self, chunks: list[SeqChunk], pending: PendingTokens | None = None) -> torch.Tensor:
        """Float32 logits [chunks with need_logits, vocab] (the whole vocabulary, on rank 0)."""
        seqs = [SeqStep(c.token_ids, c.num_past, c.slot_tables, c.need_logits, c.num_logits)
                for c in chunks]
        if pending is None:
            self.ranks.add(Forward(seqs))
        else:
            source = pending.source.contiguous()
            self.ranks.add(Forward(seqs, dict(pending.rows), source.numel()))
        self.ranks.flush()
        if pending is not None:
            group.share_from_rank0(source)
        return self.runner.execute(chunks, pending)
