"""CUDA graphs for decode steps, applied from outside the model.

At start-up the runner captures one graph per batch-size bucket (`batch_buckets`), largest first,
sharing one memory pool; capture runs every kernel first, warming Triton and cuBLAS. A step of n
one-token rows fills the smallest bucket >= n (padding rows write and attend to nothing) with one
host-to-device copy (`StaticDecodePlan`); a row whose token is still on the device (async
scheduling) gathers it from the static `source` buffer inside the graph. Speculative verify chunks
and short prefill chunks ride as one-token rows too (runner.as_decode_rows), so the buckets go past
max_batch_size up to `max_rows`; a replay computes the logits of at most max_batch_size rows.
"""

from __future__ import annotations

import logging
import time
from functools import partial

import torch

from server.models.attention import SeqLayout
from server.models.llama import LlamaModel
from server.models.triton_attention import StaticDecodePlan, TritonPagedAttention

log = logging.getLogger(__name__)
WARMUP_RUNS = 2


def batch_buckets(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8, 16, 24, 32, 48, 64]
    sizes += list(range(96, max_batch + 32, 32))
    return sorted({min(s, max_batch) for s in sizes})


class DecodeGraphs:
    def __init__(self, model: LlamaModel, attention: TritonPagedAttention, max_batch: int,
                 max_rows: int | None = None) -> None:
        self.model, self.attention = model, attention
        self.buckets = batch_buckets(max(max_batch, max_rows or 0))
        self.max_batch = self.buckets[-1]  # the most rows a replay takes
        self.max_logit_rows = max_batch  # the most rows whose logits a replay computes
        self.mixed_replays = 0  # replays of steps that held prefill or verify chunks (a metric for tests)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # every tensor a graph reads must outlive it (a freed one's memory is reused by later steps): the plans
        # hold them, logit rows included
        self.plans: dict[int, StaticDecodePlan] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.source: torch.Tensor | None = None  # [max_batch] int64: the previous step's sampled ids
        self.capture_s = 0.0

    def capture(self) -> None:
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        self.source = torch.zeros(self.max_batch, dtype=torch.int64, device=self.attention.device)
        for batch in reversed(self.buckets):
            plan = StaticDecodePlan(self.attention, batch, min(batch, self.max_logit_rows))
            run = partial(self._forward, plan)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), torch.no_grad():
                for _ in range(WARMUP_RUNS):  # compiles every Triton kernel of this shape, warms cuBLAS
                    run()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool), torch.no_grad():
                self.logits[batch] = run()
            self.graphs[batch], self.plans[batch] = graph, plan
        torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - start
        log.info("captured decode CUDA graphs for batch sizes %s in %.1f s", self.buckets, self.capture_s)

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def _forward(self, plan: StaticDecodePlan) -> torch.Tensor:
        plan.take_pending(self.source)
        return self.model.forward(plan.token_ids, plan.positions, plan.meta, plan.logit_rows)

    def run(self, seqs: list[SeqLayout], token_ids: list[int], picks: list[int] | None = None,
            source: torch.Tensor | None = None, logit_rows: list[int] | None = None) -> torch.Tensor:
        """Logits [len(seqs), vocab] of one step of one-token rows, or those of `logit_rows`; row i with
        picks[i] >= 0 takes its token from source[picks[i]]."""
        batch = self.bucket(len(seqs))
        self.plans[batch].fill(seqs, token_ids, picks, logit_rows)
        if source is not None:
            self.source[: source.numel()].copy_(source)
        self.graphs[batch].replay()
        if logit_rows is not None:
            self.mixed_replays += 1
        return self.logits[batch][: len(seqs) if logit_rows is None else len(logit_rows)]

    def fits(self, num_rows: int, num_logit_rows: int) -> bool:
        """A step of `num_rows` rows computing `num_logit_rows` rows' logits has a graph."""
        batch = self.bucket(num_rows)
        return bool(self.graphs) and batch is not None and num_logit_rows <= min(batch, self.max_logit_rows)
