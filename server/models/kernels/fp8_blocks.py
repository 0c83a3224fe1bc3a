"""The block-scaled FP8 GEMM (DeepSeek-V3 / Qwen3-FP8 checkpoints, fp8/weight.py `from_block_checkpoint`): the
weight stays float8 e4m3 in memory and is read once, at half a bf16 weight's bytes.

OUT[m, n] = sum over column blocks b of (X[m, b] @ Q[n, b].T) * S[n, b] (+ bias). The activations
are not quantized: each weight tile is widened to their dtype (exact: every e4m3 value is a bf16 and
float32 value) and each block's float32 partial sum scaled before it joins the accumulator, so the
result is the dequantized weight's product up to the order of float32 additions. BLOCK_K divides
block_k; decode's narrow column tile gives enough programs to keep the GPU's memory busy. No host
sync, no allocation outside torch's: CUDA graphs capture it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from server.models.kernels.attention import dot
from server.models.kernels.fp8 import block_m


@triton.jit(do_not_specialize=["M"])
def _fp8_block_gemm(X, W, S, B, OUT, M, N, K, stride_xm, stride_wn, stride_sn, stride_om, HAS_BIAS: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_K: tl.constexpr,
                    IEEE: tl.constexpr):
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    live_n, live_m = offs_n < N, offs_m < M
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        live_k = offs_k < K
        x = tl.load(X + offs_m[:, None] * stride_xm + offs_k[None, :], mask=live_m[:, None] & live_k[None, :],
                    other=0.0)
        w = tl.load(W + offs_n[:, None] * stride_wn + offs_k[None, :], mask=live_n[:, None] & live_k[None, :],
                    other=0.0).to(x.dtype)  # exact: e4m3 values are bf16 (and float32) values
        s = tl.load(S + offs_n * stride_sn + k0 // GROUP_K, mask=live_n, other=0.0)
        acc += dot(x, tl.trans(w), IEEE) * s[None, :]  # IEEE: float32 activations (the CPU interpreter's tests)
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=live_n, other=0.0).to(tl.float32)[None, :]
    tl.store(OUT + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(OUT.dtype.element_ty),
             mask=live_m[:, None] & live_n[None, :])


def tile_n(m: int) -> int:
    """The column tile: narrow for decode's few rows (more programs reading the weight), wider after."""
    return 32 if m <= 16 else 64 if m <= 64 else 128


def block_fp8_gemm(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, block_k: int,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] (unit column stride) in the model dtype, qweight [N, K] float8 (contiguous), scale
    [N, ceil(K / block_k)] float32 -> [M, N] in x's dtype (the module docstring's OUT)."""
    m, k = x.shape
    n = qweight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    bm, bn, bk = block_m(m), tile_n(m), min(128, block_k)
    if block_k % bk:
        raise ValueError(f"a column block of {block_k} is not a multiple of the kernel's {bk}-column tile")
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm))
    _fp8_block_gemm[grid](x, qweight, scale, scale if bias is None else bias, out, m, n, k, x.stride(0),
                          qweight.stride(0), scale.stride(0), out.stride(0), HAS_BIAS=bias is not None,
                          BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_K=block_k, IEEE=x.dtype == torch.float32,
                          num_warps=4, num_stages=3)
    return out
