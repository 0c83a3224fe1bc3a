"""FP8 routed experts as two grouped GEMMs in Triton: kernels/moe.py's tiles over FP8 e4m3 weights.

The weights are stacked `Fp8Weight`s (qweight [E, N, K], a scale per expert and output row). The
activations are quantized per row first (kernels/fp8.py `quantize_rows`), then `_gate_up_silu_fp8`
computes gate and up = (xq @ qweight.T) * xs * scale, each rounded, and h = SiLU(gate) * up; h is
quantized per row and `_down_weighted_fp8` computes y = ((hq @ qweight.T) * hs * scale, rounded) *
the routing weight. Accumulation as kernels/fp8.py's; `fp8/experts.py w8a8_experts` is the torch
reference. Routing, static shapes and graph capture are kernels/moe.py's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from server.models.fp8.weight import Fp8Weight
from server.models.kernels.fp8 import PROMOTE_K, quantize_rows
from server.models.kernels.moe import Tile, align, tiles


@triton.jit(do_not_specialize=["pairs"])
def _gate_up_silu_fp8(XQ, XS, W, WS, ROWS, TILE_EXPERT, H, pairs, top_k, hidden, inter, num_experts,
                      stride_xm, stride_we, stride_wn, stride_se, stride_hm,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PROMOTE: tl.constexpr):
    """H[pair, n] = silu(gate) * up, gate = (sum_k XQ[token, k] W[e, n, k]) * XS[token] * WS[e, n]
    and up the same with row inter + n."""
    tile, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(TILE_EXPERT + tile)
    if expert >= num_experts:
        return
    rows = tl.load(ROWS + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    live_m = rows < pairs
    tokens = tl.where(live_m, rows // top_k, 0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    live_n = offs_n < inter
    w_gate = W + expert.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn
    w_up = w_gate + inter * stride_wn
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        live_k = offs_k < hidden
        x = tl.load(XQ + tokens[:, None] * stride_xm + offs_k[None, :], mask=live_m[:, None] & live_k[None, :],
                    other=0.0)  # [BLOCK_M, BLOCK_K] float8
        mask_w = live_k[:, None] & live_n[None, :]
        acc_gate = tl.dot(x, tl.load(w_gate + offs_k[:, None], mask=mask_w, other=0.0), acc_gate,
                          max_num_imprecise_acc=PROMOTE)
        acc_up = tl.dot(x, tl.load(w_up + offs_k[:, None], mask=mask_w, other=0.0), acc_up,
                        max_num_imprecise_acc=PROMOTE)
    xs = tl.load(XS + tokens, mask=live_m, other=0.0)
    ws = WS + expert.to(tl.int64) * stride_se + offs_n
    gate = (acc_gate * xs[:, None] * tl.load(ws, mask=live_n, other=0.0)[None, :]).to(H.dtype.element_ty)
    up = (acc_up * xs[:, None] * tl.load(ws + inter, mask=live_n, other=0.0)[None, :]).to(H.dtype.element_ty)
    gate = gate.to(tl.float32)
    out = (gate / (1.0 + tl.exp(-gate))).to(H.dtype.element_ty).to(tl.float32) * up.to(tl.float32)
    tl.store(H + rows[:, None] * stride_hm + offs_n[None, :], out.to(H.dtype.element_ty),
             mask=live_m[:, None] & live_n[None, :])


@triton.jit(do_not_specialize=["pairs"])
def _down_weighted_fp8(HQ, HS, W, WS, SCALE, ROWS, TILE_EXPERT, Y, pairs, hidden, inter, num_experts,
                       stride_hm, stride_we, stride_wn, stride_se, stride_ym,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PROMOTE: tl.constexpr):
    """Y[pair, n] = ((sum_k HQ[pair, k] W[e, n, k]) * HS[pair] * WS[e, n], rounded) * SCALE[pair]."""
    tile, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(TILE_EXPERT + tile)
    if expert >= num_experts:
        return
    rows = tl.load(ROWS + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    live_m = rows < pairs
    safe = tl.where(live_m, rows, 0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    live_n = offs_n < hidden
    w = W + expert.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        live_k = offs_k < inter
        h = tl.load(HQ + safe[:, None] * stride_hm + offs_k[None, :], mask=live_m[:, None] & live_k[None, :],
                    other=0.0)
        acc = tl.dot(h, tl.load(w + offs_k[:, None], mask=live_k[:, None] & live_n[None, :], other=0.0), acc,
                     max_num_imprecise_acc=PROMOTE)
    hs = tl.load(HS + safe, mask=live_m, other=0.0)
    ws = tl.load(WS + expert.to(tl.int64) * stride_se + offs_n, mask=live_n, other=0.0)
    out = (acc * hs[:, None] * ws[None, :]).to(Y.dtype.element_ty).to(tl.float32)
    scale = tl.load(SCALE + safe, mask=live_m, other=0.0)
    tl.store(Y + rows[:, None] * stride_ym + offs_n[None, :], (out * scale[:, None]).to(Y.dtype.element_ty),
             mask=live_m[:, None] & live_n[None, :])


def fused_fp8_experts(x: torch.Tensor, gate_up: Fp8Weight, down: Fp8Weight, weights: torch.Tensor,
                      ids: torch.Tensor, tile: Tile | None = None) -> torch.Tensor:
    """x [T, hidden] in the model dtype, gate_up [E, 2I, hidden] and down [E, hidden, I] stacked FP8,
    weights [T, k] float32, ids [T, k] -> [T, hidden] in x's dtype (the `experts.ExpertsFn` contract);
    `tile`: this one instead of the warm-up's choice (kernels/moe.py `tiles`)."""
    t, hidden = x.shape
    num_experts, inter = gate_up.shape[0], down.shape[2]
    top_k = ids.shape[1]
    pairs = t * top_k
    block_m, block_n, block_k, warps = tile or tiles(gate_up, inter, pairs)
    promote = min(PROMOTE_K, block_k)
    rows, tile_expert = align(ids, num_experts, block_m)
    xq, xs = quantize_rows(x if x.stride(-1) == 1 else x.contiguous(), gate_up.input_scale)
    h = torch.zeros((pairs, inter), dtype=x.dtype, device=x.device)  # (pairs of no expert held here: 0)
    _gate_up_silu_fp8[(tile_expert.numel(), triton.cdiv(inter, block_n))](
        xq, xs, gate_up.qweight, gate_up.scale, rows, tile_expert, h, pairs, top_k, hidden, inter, num_experts,
        xq.stride(0), gate_up.qweight.stride(0), gate_up.qweight.stride(1), gate_up.scale.stride(0), h.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PROMOTE=promote, num_warps=warps)
    hq, hs = quantize_rows(h, down.input_scale)
    y = torch.zeros((pairs, hidden), dtype=x.dtype, device=x.device)
    _down_weighted_fp8[(tile_expert.numel(), triton.cdiv(hidden, block_n))](
        hq, hs, down.qweight, down.scale, weights.flatten().contiguous(), rows, tile_expert, y, pairs, hidden,
        inter, num_experts, hq.stride(0), down.qweight.stride(0), down.qweight.stride(1), down.scale.stride(0),
        y.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PROMOTE=promote, num_warps=warps)
    return y.view(t, top_k, hidden).sum(dim=1)
