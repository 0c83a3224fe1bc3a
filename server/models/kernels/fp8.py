"""FP8 e4m3 GEMM kernels: per-token activation quantization, a skinny GEMM for decode shapes, and the
scale epilogue that follows a cuBLAS GEMM with unit scales.

`quantize_rows` quantizes x [M, K] row by row, rounding to nearest even in float32 arithmetic before
the cast, so it equals torch's `.to(float8_e4m3fn)` bit for bit on the GPU and under Triton's CPU
interpreter (whose own float32 -> fp8 cast rounds wrongly at binade edges).

`fp8_gemm` is OUT = (XQ @ W.T) * xs[m] * ws[n] (+ bias), one program per BLOCK_N features and
BLOCK_M rows over the whole K (no split-K: the weight is streamed once). Its `quant` configs
quantize the activations in the GEMM itself, so a decode step's linear is one kernel (at M=1 the
launches of 128 quantization kernels would cost ~0.2 ms of an 8B model's ~3 ms step). `SWAP`
computes the transposed tile, putting the large weight dimension on the MMA's M side (Hopper's wgmma
wants M >= 64). Partial sums are promoted to float32 every PROMOTE_K products
(`max_num_imprecise_acc`), as cuBLAS does without fast accumulation.

`fp8_gemv` is weight-only (the CPU's numerics: x times the dequantized weight, nothing quantizes x) for
decode's one row: it streams the float8 weight through CUDA cores, where the tensor-core GEMMs pad the
row to a 16-row tile and cuBLAS read an 8B model's FP8 weights at ~2.0 TB/s against bf16's ~2.8 TB/s
(H100, 2026-12-07).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

FP8_MAX = tl.constexpr(448.0)  # as server/models/fp8/weight.py (kernels read globals only as constexprs)
MIN_AMAX = tl.constexpr(1e-12)
PROMOTE_K = 128
QUANT_BLOCK = 1024


@triton.jit
def _round_e4m3(v):
    """v (float32, |v| <= 448) rounded to the nearest e4m3 value, ties to even, still float32."""
    bits = v.to(tl.int32, bitcast=True)
    exp = tl.maximum((bits >> 23) & 0xFF, 127 - 6)  # below 2^-6 the e4m3 spacing stays 2^-9
    step = ((exp - 3) << 23).to(tl.float32, bitcast=True)  # 2^(e - 3): 3 mantissa bits
    inv_step = ((257 - exp) << 23).to(tl.float32, bitcast=True)  # 2^(3 - e)
    y = v * inv_step  # exact (a power of two); |y| < 16
    y = (y + 12582912.0) - 12582912.0  # 1.5 * 2^23: float32 addition rounds y to an integer, ties to even
    return y * step


@triton.jit(do_not_specialize=["K"])
def _quantize_rows(X, XQ, XS, STATIC, K, stride_x, stride_q, IS_STATIC: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    if IS_STATIC:
        s = tl.load(STATIC).to(tl.float32)
        inv = 1.0 / s
    else:
        amax = tl.zeros([BLOCK], tl.float32)
        for k0 in range(0, K, BLOCK):
            cols = k0 + tl.arange(0, BLOCK)
            x = tl.load(X + row * stride_x + cols, mask=cols < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        top = tl.maximum(tl.max(amax, 0), MIN_AMAX)
        s = top / FP8_MAX
        inv = FP8_MAX / top
    for k0 in range(0, K, BLOCK):
        cols = k0 + tl.arange(0, BLOCK)
        x = tl.load(X + row * stride_x + cols, mask=cols < K, other=0.0).to(tl.float32)
        q = _round_e4m3(tl.minimum(tl.maximum(x * inv, -FP8_MAX), FP8_MAX))
        tl.store(XQ + row * stride_q + cols, q.to(XQ.dtype.element_ty), mask=cols < K)
    tl.store(XS + row, s)


def quantize_rows(x: torch.Tensor, static: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (unit column stride) -> (xq [M, K] float8_e4m3fn, xs [M] float32), x[m] ~ xq[m] * xs[m];
    per-row max scaling, or the one `static` scale [1] for every row."""
    m, k = x.shape
    xq = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    xs = torch.empty(m, dtype=torch.float32, device=x.device)
    block = min(QUANT_BLOCK, triton.next_power_of_2(k))
    _quantize_rows[(m,)](x, xq, xs, static if static is not None else xs, k, x.stride(0), xq.stride(0),
                         IS_STATIC=static is not None, BLOCK=block, num_warps=4)
    return xq, xs


@triton.jit(do_not_specialize=["M"])
def _fp8_gemm(X, XS, STATIC, W, WS, B, OUT, M, N, K, stride_xm, stride_wn, stride_om,
              HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              SWAP: tl.constexpr, PROMOTE: tl.constexpr, QUANT: tl.constexpr, IS_STATIC: tl.constexpr):
    """OUT = (XQ @ W.T) * xs[m] * ws[n] (+ B). QUANT: X holds the activations in the model dtype and each
    program quantizes its rows itself (their max first, then each tile as it is loaded: what
    `_quantize_rows` computes, with no kernel of its own); else X is XQ (float8) and XS their scales."""
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    live_n, live_m = offs_n < N, offs_m < M
    if QUANT:
        if IS_STATIC:
            xs = tl.zeros([BLOCK_M], tl.float32) + tl.load(STATIC).to(tl.float32)
            inv = 1.0 / xs
        else:
            amax = tl.zeros([BLOCK_M], tl.float32)
            for k0 in range(0, K, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                x = tl.load(X + offs_m[:, None] * stride_xm + offs_k[None, :],
                            mask=live_m[:, None] & (offs_k < K)[None, :], other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.max(tl.abs(x), 1))
            amax = tl.maximum(amax, MIN_AMAX)
            xs = amax / FP8_MAX
            inv = FP8_MAX / amax
    else:
        xs = tl.load(XS + offs_m, mask=live_m, other=0.0)
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        live_k = offs_k < K
        w = tl.load(W + offs_n[:, None] * stride_wn + offs_k[None, :], mask=live_n[:, None] & live_k[None, :],
                    other=0.0)  # [BLOCK_N, BLOCK_K]
        x = tl.load(X + offs_m[:, None] * stride_xm + offs_k[None, :], mask=live_m[:, None] & live_k[None, :],
                    other=0.0)  # [BLOCK_M, BLOCK_K]
        if QUANT:
            scaled = tl.minimum(tl.maximum(x.to(tl.float32) * inv[:, None], -FP8_MAX), FP8_MAX)
            x = _round_e4m3(scaled).to(W.dtype.element_ty)
        if SWAP:
            acc = tl.dot(w, tl.trans(x), acc, max_num_imprecise_acc=PROMOTE)
        else:
            acc = tl.dot(x, tl.trans(w), acc, max_num_imprecise_acc=PROMOTE)
    ws = tl.load(WS + offs_n, mask=live_n, other=0.0)
    if SWAP:
        out = acc * xs[None, :] * ws[:, None]  # the same order of products as the reference: acc * xs * ws
        if HAS_BIAS:
            out += tl.load(B + offs_n, mask=live_n, other=0.0).to(tl.float32)[:, None]
        tl.store(OUT + offs_m[None, :] * stride_om + offs_n[:, None], out.to(OUT.dtype.element_ty),
                 mask=live_n[:, None] & live_m[None, :])
    else:
        out = acc * xs[:, None] * ws[None, :]
        if HAS_BIAS:
            out += tl.load(B + offs_n, mask=live_n, other=0.0).to(tl.float32)[None, :]
        tl.store(OUT + offs_m[:, None] * stride_om + offs_n[None, :], out.to(OUT.dtype.element_ty),
                 mask=live_m[:, None] & live_n[None, :])


def block_m(m: int) -> int:
    """The row tile for m rows: 16, 32 or 64 (tl.dot's smallest is 16; larger m runs in several tiles)."""
    return 16 if m <= 16 else 32 if m <= 32 else 64


# (BLOCK_N, BLOCK_K, warps, stages, swap, quant): quant = the GEMM quantizes its input rows itself
Config = tuple[int, int, int, int, bool, bool]


def fp8_gemm(x: torch.Tensor, xs: torch.Tensor | None, qweight: torch.Tensor, scale: torch.Tensor,
             bias: torch.Tensor | None, dtype: torch.dtype, config: Config,
             static: torch.Tensor | None = None) -> torch.Tensor:
    """[M, N] in `dtype` = (xq @ qweight.T) * xs[m] * scale[n] (+ bias), qweight [N, K] float8 contiguous,
    scale [N], x with unit column stride. A config that quantizes (its last field) takes x [M, K] in the
    model dtype (and the `static` input scale; xs None), the others xq [M, K] float8 and its row scales xs."""
    m, k = x.shape
    n = qweight.shape[0]
    out = torch.empty((m, n), dtype=dtype, device=x.device)
    block_n, block_k, warps, stages, swap, quant = config
    bm = block_m(m)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, bm))
    dummy = scale
    _fp8_gemm[grid](x, dummy if xs is None else xs, dummy if static is None else static, qweight, scale,
                    dummy if bias is None else bias, out, m, n, k, x.stride(0), qweight.stride(0), out.stride(0),
                    HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=block_n, BLOCK_K=block_k, SWAP=swap,
                    PROMOTE=min(PROMOTE_K, block_k), QUANT=quant, IS_STATIC=static is not None,
                    num_warps=warps, num_stages=stages)
    return out


@triton.jit(do_not_specialize=["M"])
def _scale_out(ACC, XS, WS, B, OUT, M, N, stride_a, stride_o, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    row, part = tl.program_id(0), tl.program_id(1)
    cols = part * BLOCK + tl.arange(0, BLOCK)
    live = cols < N
    acc = tl.load(ACC + row * stride_a + cols, mask=live, other=0.0)
    out = acc * tl.load(XS + row) * tl.load(WS + cols, mask=live, other=0.0)
    if HAS_BIAS:
        out += tl.load(B + cols, mask=live, other=0.0).to(tl.float32)
    tl.store(OUT + row * stride_o + cols, out.to(OUT.dtype.element_ty), mask=live)


def scale_out(acc: torch.Tensor, xs: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
              dtype: torch.dtype) -> torch.Tensor:
    """acc [M, N] float32 (a GEMM of the quantized values) -> acc * xs[m] * scale[n] (+ bias) in `dtype`."""
    m, n = acc.shape
    out = torch.empty((m, n), dtype=dtype, device=acc.device)
    block = min(1024, triton.next_power_of_2(n))
    _scale_out[(m, triton.cdiv(n, block))](acc, xs, scale, bias if bias is not None else scale, out, m, n,
                                           acc.stride(0), out.stride(0), HAS_BIAS=bias is not None, BLOCK=block)
    return out


@triton.jit
def _fp8_gemv(X, W, WS, B, OUT, N, K, stride_xm, stride_wn, stride_om,
              HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """OUT[m, n] = (sum_k X[m, k] W[n, k]) * WS[n] (+ B[n]), one row m per program column: the weight is read
    as float8 and widened in registers, X stays in the model dtype (weight-only: nothing quantizes it), and
    the float32 products are summed elementwise over K and reduced across the tile once, at the end."""
    pid_n, row = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    live_n = offs_n < N
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        live_k = offs_k < K
        w = tl.load(W + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :],
                    mask=live_n[:, None] & live_k[None, :], other=0.0)  # [BLOCK_N, BLOCK_K] float8 (N K may pass 2^31)
        x = tl.load(X + row * stride_xm + offs_k, mask=live_k, other=0.0).to(tl.float32)
        acc += w.to(tl.float32) * x[None, :]
    out = tl.sum(acc, 1) * tl.load(WS + offs_n, mask=live_n, other=0.0)
    if HAS_BIAS:
        out += tl.load(B + offs_n, mask=live_n, other=0.0).to(tl.float32)
    tl.store(OUT + row * stride_om + offs_n, out.to(OUT.dtype.element_ty), mask=live_n)


class GemvConfig(NamedTuple):
    """A weight-only FP8 GEMV launch: BLOCK_N output features by BLOCK_K of K per step, `warps` warps."""

    block_n: int
    block_k: int
    warps: int


def fp8_gemv(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
             config: GemvConfig) -> torch.Tensor:
    """x [M, K] in the model dtype (unit column stride) -> [M, N] = x @ (qweight * scale[:, None]).T (+ bias),
    qweight [N, K] float8 contiguous. Each row streams the whole weight: for decode's single row."""
    m, k = x.shape
    n = qweight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _fp8_gemv[(triton.cdiv(n, config.block_n), m)](
        x, qweight, scale, scale if bias is None else bias, out, n, k, x.stride(0), qweight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=config.block_n, BLOCK_K=config.block_k, num_warps=config.warps,
        num_stages=4)
    return out
