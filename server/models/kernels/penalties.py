"""Repetition, frequency and presence penalties of a step's penalised rows in one Triton kernel
(server/engine/penalties.py `StepPenalties`). The torch path runs about a dozen passes over
[rows, vocab] (gathers, comparisons, two `where`s, the subtractions); this reads each row's logits,
token counts and prompt flags once and writes the row once. It computes what the torch path does,
op for op in float32: a seen token's logit divided (positive) or multiplied (otherwise) by the
repetition penalty, then `- frequency * count - presence * (count > 0)`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _penalise(LOGITS, OUT, INDEX, COUNT_ROWS, COUNTS, IN_PROMPT, REP, FREQ, PRES, vocab, stride_l, stride_o,
              stride_c, stride_p, BLOCK: tl.constexpr):
    j, part = tl.program_id(0), tl.program_id(1)
    cols = part * BLOCK + tl.arange(0, BLOCK)
    live = cols < vocab
    row, crow = tl.load(INDEX + j), tl.load(COUNT_ROWS + j)
    x = tl.load(LOGITS + row * stride_l + cols, mask=live, other=0.0)
    count = tl.load(COUNTS + crow * stride_c + cols, mask=live, other=0).to(tl.float32)
    in_prompt = tl.load(IN_PROMPT + crow * stride_p + cols, mask=live, other=0)
    rep, freq, pres = tl.load(REP + j), tl.load(FREQ + j), tl.load(PRES + j)
    in_output = count > 0
    x = tl.where(in_output | (in_prompt != 0), tl.where(x > 0, x / rep, x * rep), x)
    x = x - freq * count - pres * in_output.to(tl.float32)
    tl.store(OUT + row * stride_o + cols, x, mask=live)


def penalise(logits: torch.Tensor, index: torch.Tensor, count_rows: torch.Tensor, counts: torch.Tensor,
             in_prompt: torch.Tensor, rep: torch.Tensor, freq: torch.Tensor, pres: torch.Tensor) -> torch.Tensor:
    """A copy of `logits` (float32 [rows, vocab]) with rows `index` penalised from `counts` (int32
    [C, vocab]) and `in_prompt` (bool [C, vocab]) rows `count_rows`, and the per-row penalties
    `rep`, `freq`, `pres` (float32 [n])."""
    out = logits.clone()
    n, vocab = index.numel(), logits.shape[1]
    if n:
        _penalise[(n, triton.cdiv(vocab, BLOCK))](logits, out, index, count_rows, counts, in_prompt.view(torch.uint8),
                                                   rep, freq, pres, vocab, logits.stride(0), out.stride(0),
                                                   counts.stride(0), in_prompt.stride(0), BLOCK=BLOCK)
    return out
