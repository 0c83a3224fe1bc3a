"""The start-up warm-up of the GPU fast path: the step shapes the scheduler produces run once before
the first request, so no request pays for a Triton compile, a cuDNN plan or another first use.

Pointer alignment and per-step integers are not specialised on (attention.HostInts aligns every
index part; `do_not_specialize`), so one compile serves all. The decode kernel's split count is a
compile-time constant of the batch size (kernels.attention.decode_splits): `warm_steps` runs one
mixed step per split count, each with a fresh prompt (dense prefill) and a chunk after a cached
prefix (paged prefill). cuDNN plans: dense_prefill.warm_up; decode graphs: cuda_graphs.py.

`burst_steps` (CUDA, after the capture) covers a burst's lazy first uses: each graph's first launch
(one replayed mixed step per bucket), and new cuBLAS kernels, lm_head row counts and allocator splits
(one eager step per point of a geometric grid of token counts, STEPS_PER_DOUBLING per doubling up to
max_num_tokens), decode rows taking their tokens on the device. ~1-2 s on the 8B shape. Not covered:
the sampler's and `inflight.TokenStaging`'s uploads. Nothing is cached yet, so what the steps write
into the pool is never read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from server.models.kernels.attention import decode_splits

STEPS_PER_DOUBLING = 2  # eager burst steps per doubling of the token count (a grid of ratio sqrt 2)


@dataclass(frozen=True)
class WarmStep:
    decode_rows: int  # sequences with one new token each
    prompts: tuple[int, ...] = ()  # fresh prompts' lengths (nothing cached before them)
    chunk_tokens: int = 0  # a chunk after a cached prefix of `chunk_past` tokens (0: none)
    chunk_past: int = 0
    pending: bool = False  # the decode rows read their token on the device (async scheduling)

    @property
    def num_tokens(self) -> int:
        return self.decode_rows + sum(self.prompts) + self.chunk_tokens


def warm_steps(max_batch: int, max_tokens: int, tpb: int, kv_heads: int, num_sms: int) -> list[WarmStep]:
    """One step per distinct decode split count, the first also carrying the largest fresh prompt
    the token budget allows (the GEMM and attention shapes of a full prefill step)."""
    batches: dict[int, int] = {}
    for b in range(1, max_batch + 1):
        batches.setdefault(decode_splits(b, kv_heads, num_sms), b)
    steps = []
    for i, rows in enumerate(sorted(batches.values())):
        chunk = tpb if rows + tpb + 1 <= max_tokens else 0
        budget = max_tokens - rows - chunk
        prompt = budget if i == 0 else min(budget, 2 * tpb)
        steps.append(WarmStep(rows, (prompt,) if prompt > 0 else (), chunk, tpb if chunk else 0))
    return steps


def burst_steps(max_batch: int, max_tokens: int, buckets: list[int]) -> list[WarmStep]:
    """One replayed step per graph bucket ([] without graphs), then `token_grid`'s eager steps (module doc)."""
    replayed = [_replayed(rows, max_batch) for rows in buckets]
    grid = token_grid(buckets[-1] if buckets else max_batch, max_tokens)
    counts = [min(max_batch, max(1, round(max_batch ** ((j + 1) / len(grid))))) for j in range(len(grid))]
    return replayed + [_eager(tokens, chunks) for tokens, chunks in zip(grid, counts, strict=True)]


def token_grid(low: int, high: int) -> list[int]:
    """Token counts above `low` up to `high`: STEPS_PER_DOUBLING per doubling, `high` the last."""
    out, j = [], 1
    while (tokens := math.ceil(low * 2 ** (j / STEPS_PER_DOUBLING))) < high:
        out.append(tokens)
        j += 1
    return out + [high] if high > low else []


def _replayed(rows: int, max_batch: int) -> WarmStep:
    """`rows` one-token rows: decode rows and one fresh prompt (a mixed step that fits the bucket
    exactly, its logit rows within max_batch_size); a single decode row for the bucket of 1."""
    if rows == 1:
        return WarmStep(1, pending=True)
    decode = min(rows - 2, max_batch - 1)
    return WarmStep(decode, (rows - decode,), pending=True)


def _eager(tokens: int, chunks: int) -> WarmStep:
    """`tokens` in `chunks` sequences: half of them decode rows, the rest fresh prompts of equal
    length (the last takes the remainder), each at least two tokens."""
    decode = chunks // 2
    prefill = tokens - decode
    count = max(1, min(chunks - decode, prefill // 2))
    each = prefill // count
    return WarmStep(decode, (each,) * (count - 1) + (prefill - each * (count - 1),), pending=True)


def blocks_needed(step: WarmStep, tpb: int) -> int:
    """Blocks the longest sequence of `step` spans (every sequence of it shares the same slots)."""
    longest = max(1 + tpb, *step.prompts, step.chunk_past + step.chunk_tokens)
    return math.ceil(longest / tpb)
