"""Skinny GEMMs (a few rows against a large weight: decode at small batch) as one Triton kernel.

At batch 1-8 a linear layer is a read of its weight. cuBLAS runs an 8B model's qkv and o at 74-79%
of the H200's HBM rate plus split-K reduce kernels (docs/BENCHMARKS.md); this kernel streams the
weight once with no split-K. `SkinnyLinear.choose` times both per weight shape at warm-up and keeps
cuBLAS where it is faster. The sum runs in float32 and rounds once, as cuBLAS does, in another
order: bf16 results agree with cuBLAS to rounding, not bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

MAX_ROWS = 16  # rows padded to 16 for tl.dot; above, a GEMM is no longer a read of the weight
CONFIGS = [(16, 256, 4), (16, 512, 4), (32, 256, 4), (16, 1024, 8), (32, 512, 8)]  # (BLOCK_N, BLOCK_K, warps)


@triton.jit(do_not_specialize=["M"])
def _skinny(X, W, B, OUT, M, N, K, stride_xm, stride_wn, stride_om,
            HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """OUT[m, n] = sum_k X[m, k] W[n, k] (+ B[n]) for the M (<= 16) rows, BLOCK_N features per program."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, 16)
    live_n, live_m = offs_n < N, offs_m < M
    acc = tl.zeros([16, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        live_k = offs_k < K
        w = tl.load(W + offs_n[:, None] * stride_wn + offs_k[None, :], mask=live_n[:, None] & live_k[None, :],
                    other=0.0)  # [BLOCK_N, BLOCK_K]
        x = tl.load(X + offs_m[:, None] * stride_xm + offs_k[None, :], mask=live_m[:, None] & live_k[None, :],
                    other=0.0)  # [16, BLOCK_K]
        acc += tl.dot(x, tl.trans(w))
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=live_n, other=0.0).to(tl.float32)[None, :]
    tl.store(OUT + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(OUT.dtype.element_ty),
             mask=live_m[:, None] & live_n[None, :])


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  config: tuple[int, int, int]) -> torch.Tensor:
    """x [M <= 16, K] (unit column stride), weight [N, K] contiguous -> [M, N] in x's dtype."""
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_n, block_k, warps = config
    _skinny[(triton.cdiv(n, block_n),)](x, weight, bias if bias is not None else weight, out, m, n, k, x.stride(0),
                                        weight.stride(0), out.stride(0), HAS_BIAS=bias is not None,
                                        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=3)
    return out


class SkinnyLinear:
    """`linear(x, w, b)`: the Triton kernel for rows <= MAX_ROWS where `choose` found it faster for
    that weight's shape, else F.linear. Shapes never chosen for take F.linear."""

    def __init__(self) -> None:
        self.chosen: dict[tuple[int, int], tuple[int, int, int] | None] = {}  # (N, K) -> config or None (cuBLAS)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.stride(1) == 1:
            config = self.chosen.get(tuple(weight.shape))
            if config is not None:
                return skinny_linear(x, weight, bias, config)
        return F.linear(x, weight, bias)

    def choose(self, weights: list[torch.Tensor], biases: list[torch.Tensor | None], rows: int = 1) -> None:
        """Time cuBLAS and every config over `weights` (one shape, e.g. every layer's qkv: the read misses
        L2 as in a real step) at `rows` rows (CUDA only); keep the fastest if it beats cuBLAS by 2%."""
        key = tuple(weights[0].shape)
        if key in self.chosen or weights[0].device.type != "cuda" or not all(w.is_contiguous() for w in weights):
            return
        if weights[0].dtype not in (torch.bfloat16, torch.float16):  # float32 stays exact with cuBLAS
            self.chosen[key] = None
            return
        x = torch.randn(rows, key[1], dtype=weights[0].dtype, device=weights[0].device)
        pairs = list(zip(weights, biases, strict=True))
        best, best_ms = None, cuda_ms(lambda: [F.linear(x, w, b) for w, b in pairs]) * 0.98
        for config in CONFIGS:
            try:
                ms = cuda_ms(lambda c=config: [skinny_linear(x, w, b, c) for w, b in pairs])
            except triton.runtime.errors.OutOfResources:  # too much shared memory for this GPU
                continue
            if ms < best_ms:
                best, best_ms = config, ms
        self.chosen[key] = best


def cuda_ms(fn: Callable[[], object], repeats: int = 5) -> float:
    """fn's GPU time in ms: the mean of `repeats` replays of fn captured in a CUDA graph, after one
    untimed run (eager runs where fn cannot be captured). A served step replays its kernels from a
    graph, so the host's cost of launching them is not what a warm-up choice should weigh: timed
    eagerly, a path of more kernels (cuBLAS's FP8 GEMM behind its own activation quantisation) lost
    to fused ones that were slower on the GPU (H100, 2026-12-07: b1 TPOT 5.46 ms with the choice,
    4.53 ms with cuBLAS alone)."""
    fn()
    torch.cuda.synchronize()
    run = fn
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
        run = graph.replay
    except RuntimeError:  # (something fn does cannot be captured: timed eagerly)
        torch.cuda.synchronize()
    run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref|, in float32: how a warm-up check compares a kernel with its reference."""
    out, ref = out.float(), ref.float()
    return ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
