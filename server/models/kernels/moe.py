"""The routed experts as two grouped GEMMs in Triton: no host synchronisation, static shapes.

`align` sorts a step's (token, slot) pairs by expert on the device, each expert's padded to a
multiple of BLOCK_M, so every tile belongs to one expert and the tile list has a fixed length
whatever the routing; tiles past the last real one, and those of pairs routed to no expert held
here (id E, expert parallelism), return at once. Then `_gate_up_silu` computes h = SiLU(x @ gate.T)
* (x @ up.T) per pair, and `_down_weighted` y = (h @ down.T) * the pair's routing weight. A token's
pairs are summed by one torch reduction: no atomics, the same result run to run. Both GEMMs
accumulate in float32 and round once (transformers sums in expert order, this in slot order, so
float32 results agree to rounding). Static shapes for a given T: captured in CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def tile_config(num_pairs: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps) for a step of `num_pairs` (token, slot) pairs: small tiles
    for decode (few rows per expert), larger for prefill."""
    if num_pairs <= 64:
        return 16, 64, 64, 4
    if num_pairs <= 1024:
        return 32, 64, 64, 4
    return 64, 128, 64, 8


def align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] (values 0..E, E: no expert held here) -> (rows [R] int64: each padded row's pair index
    (T * k for padding), tile_expert [R // block_m] int64: each tile's expert, >= E for the tiles of id
    E and past the last real tile). R is fixed by T, k, E and block_m; nothing is read on the host."""
    flat = ids.flatten()
    pairs = flat.numel()
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    start, padded_start = counts.cumsum(0) - counts, padded_end - padded
    order = flat.argsort(stable=True)  # pair indices grouped by expert, in token order within one
    experts = flat[order]
    dest = padded_start[experts] + torch.arange(pairs, device=ids.device) - start[experts]
    total = pairs + (num_experts + 1) * (block_m - 1)
    total = (total + block_m - 1) // block_m * block_m
    rows = torch.full((total,), pairs, dtype=torch.int64, device=ids.device).scatter_(0, dest, order)
    tile_start = torch.arange(0, total, block_m, device=ids.device)
    tile_expert = torch.searchsorted(padded_end, tile_start, right=True)  # num_experts past the end
    return rows, tile_expert


@triton.jit(do_not_specialize=["pairs"])
def _gate_up_silu(X, W, ROWS, TILE_EXPERT, H, pairs, top_k, hidden, inter, num_experts,
                  stride_xm, stride_we, stride_wn, stride_hm,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """H[pair, n] = silu(sum_k X[token, k] W[e, n, k]) * sum_k X[token, k] W[e, inter + n, k]."""
    tile, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(TILE_EXPERT + tile)
    if expert >= num_experts:
        return
    rows = tl.load(ROWS + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    live_m = rows < pairs
    tokens = rows // top_k
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    live_n = offs_n < inter
    w_gate = W + expert.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn
    w_up = w_gate + inter * stride_wn
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        live_k = offs_k < hidden
        x = tl.load(X + tokens[:, None] * stride_xm + offs_k[None, :], mask=live_m[:, None] & live_k[None, :],
                    other=0.0)  # [BLOCK_M, BLOCK_K]
        mask_w = live_k[:, None] & live_n[None, :]
        acc_gate += tl.dot(x, tl.load(w_gate + offs_k[:, None], mask=mask_w, other=0.0), input_precision="ieee")
        acc_up += tl.dot(x, tl.load(w_up + offs_k[:, None], mask=mask_w, other=0.0), input_precision="ieee")
    gate = acc_gate.to(H.dtype.element_ty).to(tl.float32)  # rounded like the unfused linear's output
    up = acc_up.to(H.dtype.element_ty).to(tl.float32)
    out = (gate / (1.0 + tl.exp(-gate))).to(H.dtype.element_ty).to(tl.float32) * up
    tl.store(H + rows[:, None] * stride_hm + offs_n[None, :], out.to(H.dtype.element_ty),
             mask=live_m[:, None] & live_n[None, :])


@triton.jit(do_not_specialize=["pairs"])
def _down_weighted(H, W, SCALE, ROWS, TILE_EXPERT, Y, pairs, hidden, inter, num_experts,
                   stride_hm, stride_we, stride_wn, stride_ym,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Y[pair, n] = (sum_k H[pair, k] W[e, n, k]) * SCALE[pair]."""
    tile, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(TILE_EXPERT + tile)
    if expert >= num_experts:
        return
    rows = tl.load(ROWS + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    live_m = rows < pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    live_n = offs_n < hidden
    w = W + expert.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        live_k = offs_k < inter
        h = tl.load(H + rows[:, None] * stride_hm + offs_k[None, :], mask=live_m[:, None] & live_k[None, :], other=0.0)
        acc += tl.dot(h, tl.load(w + offs_k[:, None], mask=live_k[:, None] & live_n[None, :], other=0.0),
                      input_precision="ieee")
    scale = tl.load(SCALE + rows, mask=live_m, other=0.0)
    out = acc.to(Y.dtype.element_ty).to(tl.float32) * scale[:, None]
    tl.store(Y + rows[:, None] * stride_ym + offs_n[None, :], out.to(Y.dtype.element_ty),
             mask=live_m[:, None] & live_n[None, :])


def fused_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor) -> torch.Tensor:
    """x [T, hidden] (unit column stride), gate_up [E, 2I, hidden] and down [E, hidden, I] contiguous,
    weights [T, k] float32, ids [T, k] -> [T, hidden] in x's dtype (the `experts.ExpertsFn` contract)."""
    t, hidden = x.shape
    num_experts, inter = gate_up.shape[0], down.shape[2]
    top_k = ids.shape[1]
    pairs = t * top_k
    block_m, block_n, block_k, warps = tile_config(pairs)
    rows, tile_expert = align(ids, num_experts, block_m)
    h = torch.empty((pairs, inter), dtype=x.dtype, device=x.device)
    _gate_up_silu[(tile_expert.numel(), triton.cdiv(inter, block_n))](
        x, gate_up, rows, tile_expert, h, pairs, top_k, hidden, inter, num_experts,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), h.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)
    y = torch.zeros((pairs, hidden), dtype=x.dtype, device=x.device)  # (pairs of no expert held here: 0)
    _down_weighted[(tile_expert.numel(), triton.cdiv(hidden, block_n))](
        h, down, weights.flatten().contiguous(), rows, tile_expert, y, pairs, hidden, inter, num_experts,
        h.stride(0), down.stride(0), down.stride(1), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)
    return y.view(t, top_k, hidden).sum(dim=1)
