"""The routed experts as two grouped GEMMs in Triton: no host synchronisation, static shapes.

`align` sorts a step's (token, slot) pairs by expert on the device, each expert's padded to a multiple
of BLOCK_M: every tile belongs to one expert and the tile list has a fixed length whatever the routing;
tiles past the last real one return at once, and those of pairs routed to no expert held here (id E,
expert parallelism) write their pairs' rows of the output as 0. A token's pairs are summed by one
torch reduction (no atomics: the same result run to run). Both GEMMs accumulate in float32 and round
once (transformers sums in expert order, this in slot order: float32 results agree to rounding).

Per-pair tiles (BLOCK_M 1, `PER_PAIR_TILES`), for decode steps of a few pairs, skip the sort: one
program per (pair, BLOCK_N outputs) reads its expert from `ids` and loops over all of K, so a one-token
top-8 step runs 8 x N / BLOCK_N programs that all read weights, where the grouped tiles launch one tile
per expert held (most empty) after `align` (one kernel up to ALIGN_PAIRS pairs, else a dozen small torch
ones). They are the same two kernels with PER_PAIR set (the pair is row 0 of a 16-row tile, tl.dot's
least), summing and rounding as the grouped tiles do; `choose_tiles` times them beside the grouped tiles
of pair classes 8 and 64.

Float, block-scaled and per-channel FP8 experts all run these kernels. Block-scaled: each weight tile
is widened to the activations' dtype (exact) and each BLOCK_K slice's product scaled by its block's
scale (FP8's bytes read, activations not quantized). Per-channel (`fused_fp8_experts`, W8A8): x
quantized per row (kernels/fp8.py `quantize_rows`), gate and up = (xq @ qweight.T) * xs * scale, each
rounded, h = SiLU(gate) * up quantized per row, y = ((hq @ qweight.T) * hs * scale, rounded) * the
routing weight; accumulation as kernels/fp8.py's, torch reference tests/fp8_reference.py `w8a8_experts`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

import torch
import triton
import triton.language as tl

from server.models.fp8.weight import Fp8Weight
from server.models.kernels.fp8 import PROMOTE_K, quantize_rows
from server.models.kernels.gemv import cuda_ms, relative_error

log = logging.getLogger(__name__)
CHECK_TOLERANCE = 2e-2  # max |out - default tile's| / max |default's| (bf16 rounds at 2^-8)

Tile = tuple[int, int, int, int]  # (BLOCK_M, BLOCK_N, BLOCK_K, warps); BLOCK_M 1: a per-pair tile
PAIR_ROWS = 16  # the rows of a per-pair tile's tl.dot: its pair and 15 dead rows
# decode's candidates without the sort: BLOCK_K long enough to stream the weight (a block-scaled weight's
# BLOCK_K is cut to its column block), a few hundred programs and more for a one-token step
PER_PAIR_TILES: tuple[Tile, ...] = ((1, 16, 128, 4), (1, 16, 256, 4), (1, 32, 128, 4))
ALIGN_PAIRS = 1024  # up to this many pairs `align` is one kernel (its counts are [16 experts, pairs] tiles)
PAIR_CLASSES = (8, 64, 256, 1024, 4096)  # a step of p (token, slot) pairs takes the choice of the first class >= p
# what `choose_tiles` times per class (the grouped tiles' BLOCK_K 64 divides a block-scaled weight's 128-column
# blocks; 16-row tiles up to class 1024: c=64 of a 128-expert top-8 model is ~4 pairs per expert); the default
# tile (`tile_config`) is grouped, a per-pair one runs where the warm-up timed it faster
CANDIDATES: dict[int, tuple[Tile, ...]] = {
    8: ((16, 64, 64, 4), (16, 32, 64, 4), (16, 128, 64, 4), *PER_PAIR_TILES),
    64: ((16, 64, 64, 4), (16, 128, 64, 4), (32, 64, 64, 4), *PER_PAIR_TILES),
    256: ((32, 64, 64, 4), (16, 64, 64, 4), (32, 128, 64, 4), (64, 64, 64, 4)),
    1024: ((32, 64, 64, 4), (16, 64, 64, 4), (16, 128, 64, 4), (64, 64, 64, 4), (64, 128, 64, 8)),
    4096: ((64, 128, 64, 8), (64, 64, 64, 4), (128, 128, 64, 8)),
}
# (experts, intermediate, hidden, weight dtype, pair class) -> the tile `choose_tiles` timed fastest here
CHOSEN: dict[tuple[int, int, int, torch.dtype, int], Tile] = {}


def tile_config(num_pairs: int) -> Tile:
    """The default tile for `num_pairs` (token, slot) pairs: small for decode (few rows per expert)."""
    if num_pairs <= 64:
        return 16, 64, 64, 4
    if num_pairs <= 1024:
        return 32, 64, 64, 4
    return 64, 128, 64, 8


def pair_class(num_pairs: int) -> int:
    return next((c for c in PAIR_CLASSES if num_pairs <= c), PAIR_CLASSES[-1])


def tiles(gate_up: torch.Tensor, down_inter: int, num_pairs: int) -> Tile:
    """The tile for these experts' weights at this step size: the warm-up's choice, else the default."""
    key = (gate_up.shape[0], down_inter, gate_up.shape[-1], _weight_dtype(gate_up), pair_class(num_pairs))
    return CHOSEN.get(key) or tile_config(num_pairs)


def _weight_dtype(w: torch.Tensor | Fp8Weight) -> torch.dtype:
    return w.qweight.dtype if isinstance(w, Fp8Weight) else w.dtype


def align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] (values 0..E, E: no expert held here) -> (rows [R] int64: each padded row's pair index
    (T * k for padding), tile_expert [R // block_m] int64: each tile's expert, >= E for the tiles of id
    E and past the last real tile). R is fixed by T, k, E and block_m; nothing is read on the host.
    Up to ALIGN_PAIRS pairs one kernel (`_align`), else a dozen small torch ones."""
    flat = ids.flatten()
    pairs = flat.numel()
    if pairs <= ALIGN_PAIRS:
        return _align_fused(flat, num_experts, block_m)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    start, padded_start = counts.cumsum(0) - counts, padded_end - padded
    order = flat.argsort(stable=True)  # pair indices grouped by expert, in token order within one
    experts = flat[order]
    dest = padded_start[experts] + torch.arange(pairs, device=ids.device) - start[experts]
    total = _align_rows(pairs, num_experts, block_m)
    rows = torch.full((total,), pairs, dtype=torch.int64, device=ids.device).scatter_(0, dest, order)
    tile_start = torch.arange(0, total, block_m, device=ids.device)
    tile_expert = torch.searchsorted(padded_end, tile_start, right=True)  # num_experts past the end
    return rows, tile_expert


def _align_rows(pairs: int, num_experts: int, block_m: int) -> int:
    """R: every pair, plus at most block_m - 1 padding rows for each of the E + 1 ids, in whole tiles."""
    total = pairs + (num_experts + 1) * (block_m - 1)
    return (total + block_m - 1) // block_m * block_m


@triton.jit(do_not_specialize=["pairs", "total"])
def _align(IDS, ROWS, TILE_EXPERT, pairs, num_experts, total,
           BLOCK_M: tl.constexpr, PP: tl.constexpr, EB: tl.constexpr, FILL: tl.constexpr):
    """`align` in one program: each pair's row is its expert's padded start (a running sum of the padded
    counts, EB experts at a time) plus its rank among that expert's pairs in token order (a running count
    along the pairs); the rows are filled with `pairs`, the pairs written to their rows, then each tile's
    expert read from its first row (a tile lies within one expert's rows and starts with a real one;
    past the last: E + 1, as searchsorted gives)."""
    offs_p = tl.arange(0, PP)
    live_p = offs_p < pairs
    ids = tl.load(IDS + offs_p, mask=live_p, other=-1).to(tl.int32)
    live_p = live_p & (ids >= 0) & (ids <= num_experts)  # (an id out of range lands nowhere, not before ROWS)
    ids = tl.where(live_p, ids, -1)  # -1: in no expert's count
    rank = tl.zeros([PP], tl.int32)
    start = tl.zeros([PP], tl.int32)
    carry = 0
    for e0 in range(0, num_experts + 1, EB):
        offs_e = e0 + tl.arange(0, EB)
        hit = ids[None, :] == offs_e[:, None]  # [EB, PP]
        ones = hit.to(tl.int32)
        rank += tl.sum(tl.where(hit, tl.cumsum(ones, 1), 0), 0)
        counts = tl.sum(ones, 1)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        padded_start = tl.cumsum(padded, 0) - padded + carry
        start += tl.sum(tl.where(hit, padded_start[:, None], 0), 0)
        carry += tl.sum(padded, 0)
    for r0 in range(0, total, FILL):
        offs_r = r0 + tl.arange(0, FILL)
        tl.store(ROWS + offs_r, tl.full([FILL], 0, tl.int64) + pairs, mask=offs_r < total)
    tl.debug_barrier()  # (the fill is seen before the pairs land)
    tl.store(ROWS + start + rank - 1, offs_p.to(tl.int64), mask=live_p)
    tl.debug_barrier()
    for t0 in range(0, total // BLOCK_M, FILL):
        offs_t = t0 + tl.arange(0, FILL)
        live_t = offs_t < total // BLOCK_M
        first = tl.load(ROWS + offs_t * BLOCK_M, mask=live_t, other=pairs)
        expert = tl.load(IDS + first, mask=first < pairs, other=num_experts + 1)
        tl.store(TILE_EXPERT + offs_t, expert.to(tl.int64), mask=live_t)


def _align_fused(flat: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = flat.numel()
    total = _align_rows(pairs, num_experts, block_m)
    rows = torch.empty(total, dtype=torch.int64, device=flat.device)
    tile_expert = torch.empty(total // block_m, dtype=torch.int64, device=flat.device)
    # PP by pair class: the variants `choose_tiles` compiles at warm-up (each class's size, each tile) are
    # the ones serving runs
    _align[(1,)](flat, rows, tile_expert, pairs, num_experts, total, BLOCK_M=block_m,
                 PP=max(16, pair_class(pairs)), EB=16, FILL=1024, num_warps=8)
    return rows, tile_expert


@triton.jit
def _accumulate(acc, x, w, S, offs_s, live_s, k0, BLOCKED: tl.constexpr, GROUP_K: tl.constexpr,
                W8A8: tl.constexpr, PROMOTE: tl.constexpr):
    """acc + x @ w in float32 (constexpr branches: only the one taken is compiled). W8A8: x and w float8
    (their scales come after the loop, `_dequantized`), partial sums promoted every PROMOTE products;
    BLOCKED: w float8, widened to x's dtype (exact), the product scaled by S[offs_s + k0 // GROUP_K],
    the weight's scale for these columns and this block of rows of w."""
    if W8A8:
        acc = tl.dot(x, w, acc, max_num_imprecise_acc=PROMOTE)
    elif BLOCKED:
        s = tl.load(S + offs_s + k0 // GROUP_K, mask=live_s, other=0.0)
        acc += tl.dot(x, w.to(x.dtype), input_precision="ieee") * s[None, :]
    else:
        acc += tl.dot(x, w, input_precision="ieee")
    return acc


@triton.jit
def _dequantized(acc, XS, offs_m, live_m, S, offs_s, live_s, W8A8: tl.constexpr):
    """W8A8: acc times the rows' activation scales XS[offs_m] and the columns' weight scales S[offs_s]."""
    if W8A8:
        xs = tl.load(XS + offs_m, mask=live_m, other=0.0)
        acc = acc * xs[:, None] * tl.load(S + offs_s, mask=live_s, other=0.0)[None, :]
    return acc


@triton.jit
def _tile(ROWS, TILE_EXPERT, pairs, BLOCK_M: tl.constexpr, PER_PAIR: tl.constexpr):
    """(expert, rows [BLOCK_M]) of this program's tile: PER_PAIR, TILE_EXPERT is the pairs' expert ids and
    the program's pair is its row 0 (rows 1.. are `pairs`: dead); else `align`'s expert and rows."""
    tile = tl.program_id(0)
    expert = tl.load(TILE_EXPERT + tile)
    if PER_PAIR:
        rows = tl.where(tl.arange(0, BLOCK_M) == 0, tile.to(tl.int64), pairs)
    else:
        rows = tl.load(ROWS + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    return expert, rows


@triton.jit(do_not_specialize=["pairs"])
def _gate_up_silu(X, XS, W, S, ROWS, TILE_EXPERT, H, pairs, top_k, hidden, inter, num_experts,
                  stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_hm,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  BLOCKED: tl.constexpr, GROUP_K: tl.constexpr, W8A8: tl.constexpr, PROMOTE: tl.constexpr,
                  PER_PAIR: tl.constexpr):
    """H[pair, n] = silu(sum_k X[token, k] W[e, n, k]) * sum_k X[token, k] W[e, inter + n, k], each sum
    rounded (BLOCKED: W float8 with S[e, n, k // GROUP_K] a scale per row and block of columns; W8A8:
    X and W float8, each sum times XS[token] * S[e, n]). A program: a tile of rows of one expert (`_tile`)
    and BLOCK_N columns of gate and of up."""
    expert, rows = _tile(ROWS, TILE_EXPERT, pairs, BLOCK_M, PER_PAIR)
    if expert >= num_experts:
        return
    pid_n = tl.program_id(1)
    live_m = rows < pairs
    tokens = tl.where(live_m, rows // top_k, 0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    live_n = offs_n < inter
    w_gate = W + expert.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn
    w_up = w_gate + inter * stride_wn
    s_gate = expert.to(tl.int64) * stride_se + offs_n * stride_sn
    s_up = s_gate + inter * stride_sn
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        live_k = offs_k < hidden
        x = tl.load(X + tokens[:, None] * stride_xm + offs_k[None, :], mask=live_m[:, None] & live_k[None, :],
                    other=0.0)  # [BLOCK_M, BLOCK_K]
        mask_w = live_k[:, None] & live_n[None, :]
        acc_gate = _accumulate(acc_gate, x, tl.load(w_gate + offs_k[:, None], mask=mask_w, other=0.0), S, s_gate,
                               live_n, k0, BLOCKED, GROUP_K, W8A8, PROMOTE)
        acc_up = _accumulate(acc_up, x, tl.load(w_up + offs_k[:, None], mask=mask_w, other=0.0), S, s_up,
                             live_n, k0, BLOCKED, GROUP_K, W8A8, PROMOTE)
    # rounded like the unfused linear's output
    gate = _dequantized(acc_gate, XS, tokens, live_m, S, s_gate, live_n, W8A8).to(H.dtype.element_ty).to(tl.float32)
    up = _dequantized(acc_up, XS, tokens, live_m, S, s_up, live_n, W8A8).to(H.dtype.element_ty).to(tl.float32)
    out = (gate / (1.0 + tl.exp(-gate))).to(H.dtype.element_ty).to(tl.float32) * up
    tl.store(H + rows[:, None] * stride_hm + offs_n[None, :], out.to(H.dtype.element_ty),
             mask=live_m[:, None] & live_n[None, :])


@triton.jit(do_not_specialize=["pairs"])
def _down_weighted(H, HS, W, S, SCALE, ROWS, TILE_EXPERT, Y, pairs, hidden, inter, num_experts,
                   stride_hm, stride_we, stride_wn, stride_se, stride_sn, stride_ym,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   BLOCKED: tl.constexpr, GROUP_K: tl.constexpr, W8A8: tl.constexpr, PROMOTE: tl.constexpr,
                   PER_PAIR: tl.constexpr):
    """Y[pair, n] = (sum_k H[pair, k] W[e, n, k], rounded) * SCALE[pair] (BLOCKED, W8A8: as
    `_gate_up_silu`, HS the rows' activation scales); 0 for a pair of no expert held here (id E)."""
    expert, rows = _tile(ROWS, TILE_EXPERT, pairs, BLOCK_M, PER_PAIR)
    pid_n = tl.program_id(1)
    live_m = rows < pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    live_n = offs_n < hidden
    if expert >= num_experts:  # pairs of no expert held here: 0 (past the last tile: no real rows)
        tl.store(Y + rows[:, None] * stride_ym + offs_n[None, :], tl.zeros([BLOCK_M, BLOCK_N], Y.dtype.element_ty),
                 mask=live_m[:, None] & live_n[None, :])
        return
    safe = tl.where(live_m, rows, 0)
    w = W + expert.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn
    s = expert.to(tl.int64) * stride_se + offs_n * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        live_k = offs_k < inter
        h = tl.load(H + safe[:, None] * stride_hm + offs_k[None, :], mask=live_m[:, None] & live_k[None, :], other=0.0)
        acc = _accumulate(acc, h, tl.load(w + offs_k[:, None], mask=live_k[:, None] & live_n[None, :], other=0.0),
                          S, s, live_n, k0, BLOCKED, GROUP_K, W8A8, PROMOTE)
    out = _dequantized(acc, HS, safe, live_m, S, s, live_n, W8A8).to(Y.dtype.element_ty).to(tl.float32)
    scale = tl.load(SCALE + safe, mask=live_m, other=0.0)
    tl.store(Y + rows[:, None] * stride_ym + offs_n[None, :], (out * scale[:, None]).to(Y.dtype.element_ty),
             mask=live_m[:, None] & live_n[None, :])


def fused_experts(x: torch.Tensor, gate_up: torch.Tensor | Fp8Weight, down: torch.Tensor | Fp8Weight,
                  weights: torch.Tensor, ids: torch.Tensor, tile: Tile | None = None, *,
                  w8a8: bool = False) -> torch.Tensor:
    """The `experts.ExpertsFn` contract (the result in x's dtype), x with unit column stride, gate_up and
    down contiguous (or block-scaled stacked `Fp8Weight`s); `tile`: this one instead of `tiles`' choice.
    `w8a8` (`fused_fp8_experts`): per-channel stacked FP8 experts, x and h quantized per row first."""
    t, hidden = x.shape
    num_experts, inter = gate_up.shape[0], down.shape[2]
    top_k = ids.shape[1]
    pairs = t * top_k
    block_m, block_n, block_k, warps = tile or tiles(gate_up, inter, pairs)
    (gu, gu_s, gu_strides), (dn, dn_s, dn_strides) = _operand(gate_up), _operand(down)
    group_k = gate_up.block_k if isinstance(gate_up, Fp8Weight) and not w8a8 else 0
    per_pair = block_m == 1
    if per_pair and group_k:
        block_k = min(block_k, group_k)  # a K step reads one scale per column: within one column block
    if group_k % block_k:
        raise ValueError(f"a column block of {group_k} is not a multiple of the {block_k}-column tile")
    consts = dict(BLOCK_M=PAIR_ROWS if per_pair else block_m, BLOCK_N=block_n, BLOCK_K=block_k, BLOCKED=group_k > 0,
                  GROUP_K=max(group_k, block_k), W8A8=w8a8, PROMOTE=min(PROMOTE_K, block_k), PER_PAIR=per_pair,
                  num_warps=warps)
    # per pair: a program per pair, its expert read from ids (ROWS unread); else `align`'s tiles
    rows, tile_expert = (ids.reshape(-1),) * 2 if per_pair else align(ids, num_experts, block_m)
    dtype, xs = x.dtype, gu_s  # (xs: unread unless w8a8)
    if w8a8:
        x, xs = quantize_rows(x if x.stride(-1) == 1 else x.contiguous(), gate_up.input_scale)
    # pairs of no expert held here: 0 (an FP8 h is quantized per row, garbage rows included)
    h = (torch.zeros if w8a8 else torch.empty)((pairs, inter), dtype=dtype, device=x.device)
    _gate_up_silu[(tile_expert.numel(), triton.cdiv(inter, block_n))](
        x, xs, gu, gu_s, rows, tile_expert, h, pairs, top_k, hidden, inter, num_experts,
        x.stride(0), gu.stride(0), gu.stride(1), *gu_strides, h.stride(0), **consts)
    hs = gu_s
    if w8a8:
        h, hs = quantize_rows(h, down.input_scale)
    y = torch.empty((pairs, hidden), dtype=dtype, device=x.device)  # (pairs of no expert held here: 0s written)
    _down_weighted[(tile_expert.numel(), triton.cdiv(hidden, block_n))](
        h, hs, dn, dn_s, weights.flatten().contiguous(), rows, tile_expert, y, pairs, hidden, inter, num_experts,
        h.stride(0), dn.stride(0), dn.stride(1), *dn_strides, y.stride(0), **consts)
    return y.view(t, top_k, hidden).sum(dim=1)


fused_fp8_experts = partial(fused_experts, w8a8=True)


def _operand(w: torch.Tensor | Fp8Weight) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
    """(weight, scales, the scales' expert and row strides); a float weight's scales are itself, unread."""
    if isinstance(w, Fp8Weight):
        return w.qweight, w.scale, (w.scale.stride(0), w.scale.stride(1))
    return w, w, (0, 0)


def choose_tiles(run: Callable[..., torch.Tensor], gate_up: torch.Tensor | Fp8Weight, down: torch.Tensor | Fp8Weight,
                 top_k: int, dtype: torch.dtype, max_tokens: int) -> None:
    """At warm-up, on CUDA, per pair class a step of up to `max_tokens` tokens reaches: the fastest
    CANDIDATES tile of `run` (fused_experts or fused_fp8_experts) at the class's largest size, random
    routing, into CHOSEN (`_fastest_tile`)."""
    num_experts, inter, hidden = gate_up.shape[0], down.shape[2], gate_up.shape[-1]
    device = gate_up.qweight.device if isinstance(gate_up, Fp8Weight) else gate_up.device
    for cls in PAIR_CLASSES:
        tokens = max(1, cls // top_k)
        key = (num_experts, inter, hidden, _weight_dtype(gate_up), cls)
        if tokens > max_tokens or key in CHOSEN:
            continue
        x = torch.randn(tokens, hidden, dtype=dtype, device=device)
        ids = torch.rand(tokens, num_experts, device=device).topk(top_k, dim=1).indices
        weights = torch.rand(tokens, top_k, device=device)
        CHOSEN[key] = _fastest_tile(lambda tile: run(x, gate_up, down, weights, ids, tile), cls)  # noqa: B023


def _fastest_tile(step: Callable[[Tile], torch.Tensor], cls: int) -> Tile:
    """The candidate tile of pair class `cls` that runs `step` fastest and computes what the default does
    (one that computes wrong or fails on this GPU is skipped, not served)."""
    ref = step(tile_config(cls))
    timings = {}
    for tile in CANDIDATES[cls]:
        try:
            error = relative_error(step(tile), ref)
            if error > CHECK_TOLERANCE:
                log.warning("MoE tile %s at %d pairs is off by %.3g of the default tile: not used", tile, cls, error)
                continue
            timings[tile] = cuda_ms(lambda t=tile: step(t))
        except Exception as exc:  # noqa: BLE001 (a tile this GPU cannot compile or run is skipped)
            log.warning("MoE tile %s at %d pairs failed here: %s", tile, cls, exc)
    return min(timings, key=timings.get) if timings else tile_config(cls)


def block_experts_compute(gate_up: Fp8Weight, down: Fp8Weight, dtype: torch.dtype) -> bool:
    """At warm-up: do the grouped kernels compute block-scaled experts as the torch path does with the
    dequantized weights on this GPU (a decode step and a prefill step, the first experts' weights)?"""
    from server.models.moe.experts import dense_experts

    top_k = min(2, gate_up.shape[0])
    part_up, part_down = (Fp8Weight(w.qweight[:top_k], w.scale[:top_k], w.input_scale, w.block_k)
                          for w in (gate_up, down))
    try:
        for tokens in (1, 64):
            x = torch.randn(tokens, gate_up.shape[-1], dtype=dtype, device=gate_up.qweight.device)
            ids = torch.arange(top_k, device=x.device).repeat(tokens, 1)
            weights = torch.rand(tokens, top_k, device=x.device)
            ref = dense_experts(x.float(), part_up.dequantize(), part_down.dequantize(), weights, ids)
            if relative_error(fused_experts(x, part_up, part_down, weights, ids), ref) > CHECK_TOLERANCE:
                raise ValueError(f"off at {tokens} tokens")
    except Exception as exc:  # noqa: BLE001 (kernels this GPU cannot compile or run are not served)
        log.warning("grouped block-scaled FP8 experts %s: %s; the experts run dequantized", tuple(gate_up.shape), exc)
        return False
    return True
