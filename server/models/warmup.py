"""The start-up warm-up of the GPU fast path: every step shape the scheduler can produce runs once
before the first request, so no request pays for a Triton compile or a cuDNN plan.

What varies between steps, and how each is covered:
- pointer alignment and per-step integers (token counts, block-table widths): not specialised on
  (every index part is 16-byte aligned, triton_attention._Ints; `do_not_specialize` on the kernels'
  varying integers), so one compile serves every step;
- the decode kernel's split count, a compile-time constant chosen from the decode batch size
  (kernels.attention.decode_splits): one mixed prefill+decode step per distinct split count over
  batch sizes 1..max_batch_size, each with a fresh prompt (dense prefill) and a chunk after a
  cached prefix (the paged prefill kernel);
- cuDNN prefill plans: one per prompt-length bucket up to max_num_tokens (dense_prefill.warm_up);
- decode-only steps: CUDA graphs captured per batch bucket (cuda_graphs.py).
Nothing is cached yet while this runs, so what the steps write into the pool is never read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from server.models.kernels.attention import decode_splits


@dataclass(frozen=True)
class WarmStep:
    decode_rows: int  # sequences with one new token each
    prompt_tokens: int  # a fresh prompt (0: none)
    chunk_tokens: int  # a chunk after a cached prefix of `chunk_past` tokens (0: none)
    chunk_past: int


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
        steps.append(WarmStep(rows, max(0, prompt), chunk, tpb if chunk else 0))
    return steps


def blocks_needed(step: WarmStep, tpb: int) -> int:
    """Blocks the longest sequence of `step` spans (every sequence of it shares the same slots)."""
    longest = max(1 + tpb, step.prompt_tokens, step.chunk_past + step.chunk_tokens)
    return math.ceil(longest / tpb)
