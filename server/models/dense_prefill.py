"""Attention of a prefill chunk with nothing cached before it: one fused causal SDPA over the
chunk's own contiguous q/k/v (the Triton backend's "dense" path, triton_attention.py).

`PDSERVE_DENSE_PREFILL` (read per call, so a benchmark can compare kernels in one process):
- "auto" (default): cuDNN for bf16/fp16 prompts of at least CUDNN_MIN_TOKENS tokens (~460 TFLOP/s
  at 4k on the H200 against FlashAttention-2's ~250), FlashAttention below. cuDNN builds a plan per
  new sequence length (~0.9 s), so prompts are padded at their end to a multiple of CUDNN_BUCKET
  and `warm_up` builds every bucket's plan; causal attention never lets a real query see the padding.
- "flash": FlashAttention only; "cudnn": cuDNN at the exact length; "triton": the paged Triton
  prefill kernel for every prompt.
float32 (no fused kernel takes it with GQA) runs torch's math kernel, unpadded, so it stays
token-exact against transformers.
"""

from __future__ import annotations

import math
import os
import time
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

CUDNN_MIN_TOKENS = 1024  # below, attention is a small share of a prefill and FlashAttention is close
CUDNN_BUCKET = 512  # prompt lengths are padded up to a multiple of this (at most 511 wasted keys)
_FUSED_DTYPES = (torch.bfloat16, torch.float16)
_FLASH = [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
_CUDNN = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]


def dense_prefill_kind() -> str:
    """"auto", "flash", "cudnn" or "triton" (PDSERVE_DENSE_PREFILL)."""
    return os.environ.get("PDSERVE_DENSE_PREFILL", "auto")


def cudnn_bucket(num_tokens: int) -> int | None:
    """The padded length cuDNN runs a prompt of `num_tokens` at under "auto"; None: FlashAttention."""
    if num_tokens < CUDNN_MIN_TOKENS:
        return None
    return math.ceil(num_tokens / CUDNN_BUCKET) * CUDNN_BUCKET


def causal_sdpa(qkv: torch.Tensor, heads: int, kv_heads: int, scale: float) -> torch.Tensor:
    """qkv [n, heads + 2 kv_heads, D] of one chunk with nothing before it -> [n, heads, D]."""
    n = qkv.shape[0]
    if qkv.device.type != "cuda":
        return _sdpa(qkv, heads, kv_heads, scale, None)
    kind = dense_prefill_kind()
    bucket = cudnn_bucket(n) if kind == "auto" and qkv.dtype in _FUSED_DTYPES else None
    if bucket is not None:
        padded = qkv.new_zeros((bucket, *qkv.shape[1:]))  # [bucket, heads + 2 kv_heads, D]
        padded[:n] = qkv
        return _sdpa(padded, heads, kv_heads, scale, _CUDNN)[:n]
    return _sdpa(qkv, heads, kv_heads, scale, _CUDNN if kind == "cudnn" else _FLASH)


def _sdpa(qkv: torch.Tensor, heads: int, kv_heads: int, scale: float,
          backends: list[SDPBackend] | None) -> torch.Tensor:
    q = qkv[:, :heads].transpose(0, 1)[None]  # [1, heads, n, D]
    k = qkv[:, heads:heads + kv_heads].transpose(0, 1)[None]
    v = qkv[:, heads + kv_heads:].transpose(0, 1)[None]
    with nullcontext() if backends is None else sdpa_kernel(backends):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def warm_up(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
            max_tokens: int) -> tuple[int, float]:
    """Build the cuDNN plan of each bucket a prompt of up to `max_tokens` uses ("auto"): (plans, seconds)."""
    if device.type != "cuda" or dtype not in _FUSED_DTYPES or dense_prefill_kind() != "auto":
        return 0, 0.0
    start = time.perf_counter()
    lengths = sorted({b for n in range(CUDNN_MIN_TOKENS, max_tokens + 1, CUDNN_BUCKET)
                      if (b := cudnn_bucket(n)) is not None} | ({cudnn_bucket(max_tokens)} - {None}))
    qkv = torch.randn(lengths[-1], heads + 2 * kv_heads, head_dim, dtype=dtype, device=device) if lengths else None
    for length in lengths:
        causal_sdpa(qkv[:length], heads, kv_heads, head_dim**-0.5)
    torch.cuda.synchronize(device)
    return len(lengths), time.perf_counter() - start
