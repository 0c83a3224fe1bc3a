"""Triton paged attention over pdserve's slot-major KV pools: decode (split-K) and prefill.

K and V are read in place through block tables (no per-step gather), with GQA (the q heads sharing
a kv head are the rows of one tile) and sliding windows. Every index is a device tensor and launch
grids depend only on host-known sizes, so decode is CUDA-graph capturable (the split size is derived
from each sequence's length inside the kernel, never frozen as a scalar).

Pool views: K, V each [slots, tpb, kv_heads, head_dim], strides (S, H*D, D, 1). A query at position p
sees keys lo <= k <= p. An FP8 cache's K and V are loaded as e4m3 (decode reads half the bytes) and
widened exactly; k_scale is folded into the softmax scale and v_scale into the output.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
DECODE_BLOCK_N = 64
PREFILL_BLOCK_M = 64  # query rows (token, head-of-group) per tile
PREFILL_BLOCK_N = 64  # keys per inner step


@triton.jit
def dot(a, b, IEEE: tl.constexpr):
    """a @ b in float32; IEEE (float32 inputs): no TF32 rounding."""
    if IEEE:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def split_range(SEQ, LO, b, s, NSPLIT: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys [start, end) of split `s` of sequence `b`: its keys LO[b] <= k < SEQ[b] in NSPLIT chunks of
    whole BLOCK_N steps (sized from the length inside the kernel, so a captured graph fits any length)."""
    lo = tl.load(LO + b)
    seq_len = tl.load(SEQ + b)
    chunk = tl.cdiv(tl.cdiv(seq_len - lo, NSPLIT), BLOCK_N) * BLOCK_N
    start = lo + s * chunk
    return start, tl.minimum(start + chunk, seq_len)


# Arguments that change from step to step are not specialised on (Triton would compile a variant
# per value class: == 1, divisible by 16, other); the launch-time cost of that is nil here.
@triton.jit(do_not_specialize=["stride_bt"])
def _decode_split(Q, K, V, BT, SEQ, LO, OP, MP, LP,
                  stride_qt, stride_qh, stride_ks, stride_kt, stride_kh, stride_bt, sm_scale_log2,
                  KVH: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, TPB: tl.constexpr,
                  NSPLIT: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, FP16_DOT: tl.constexpr):
    """One (sequence, kv head, split): softmax partials of its query heads over its key range. FP16_DOT (an
    FP8 cache, bf16 queries): K and V widen to float16, one conversion per two values where bfloat16 takes
    several (the FP8 decode was bound by them), and the products run in float16: q pre-scaled by the
    softmax scale (well inside float16's range), p in [0, 1]."""
    b, h, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, end = split_range(SEQ, LO, b, s, NSPLIT, BLOCK_N)
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    q = tl.load(Q + b * stride_qt + (h * G + offs_g)[:, None] * stride_qh + offs_d[None, :],
                mask=(offs_g < G)[:, None], other=0.0)
    if FP16_DOT:
        q = (q.to(tl.float32) * sm_scale_log2).to(tl.float16)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        tok = n0 + offs_n
        live = tok < end
        page = tl.load(BT + b * stride_bt + tok // TPB, mask=live, other=0).to(tl.int64)
        off = page * stride_ks + (tok % TPB) * stride_kt + h * stride_kh
        k = tl.load(K + off[:, None] + offs_d[None, :], mask=live[:, None], other=0.0).to(q.dtype)
        qk = dot(q, tl.trans(k), IEEE)
        if not FP16_DOT:
            qk = qk * sm_scale_log2
        qk = tl.where(live[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + off[:, None] + offs_d[None, :], mask=live[:, None], other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, IEEE)
        m_i = m_new
    base = ((b * KVH + h) * NSPLIT + s) * GP
    tl.store(OP + (base + offs_g)[:, None] * D + offs_d[None, :], acc)
    tl.store(MP + base + offs_g, m_i)
    tl.store(LP + base + offs_g, l_i)


@triton.jit
def _decode_merge(OP, MP, LP, OUT, stride_ot, stride_oh, v_scale,
                  KVH: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                  NSPLIT: tl.constexpr, SP: tl.constexpr):
    """One (sequence, q head): merge the splits' partials (times v_scale); a sequence with no keys
    gets zeros."""
    b, qh = tl.program_id(0), tl.program_id(1)
    h, g = qh // G, qh % G
    offs_s = tl.arange(0, SP)
    offs_d = tl.arange(0, D)
    live = offs_s < NSPLIT
    rows = ((b * KVH + h) * NSPLIT + offs_s) * GP + g
    m = tl.load(MP + rows, mask=live, other=float("-inf"))
    m_max = tl.max(m, 0)
    w = tl.where(m > float("-inf"), tl.exp2(m - m_max), 0.0)
    total = tl.sum(tl.load(LP + rows, mask=live, other=0.0) * w, 0)
    acc = tl.load(OP + rows[:, None] * D + offs_d[None, :], mask=live[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(total > 0, total, 1.0) * v_scale
    tl.store(OUT + b * stride_ot + qh * stride_oh + offs_d, out.to(OUT.dtype.element_ty))


@triton.jit(do_not_specialize=["stride_bt", "window"])
def _prefill(Q, K, V, OUT, BT, TILE_SEQ, TILE_ROW, TILE_POS, TILE_N, LO_SEQ,
             stride_qt, stride_qh, stride_ot, stride_oh, stride_ks, stride_kt, stride_kh, stride_bt,
             sm_scale_log2, v_scale, window,
             G: tl.constexpr, D: tl.constexpr, TPB: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """One (tile of query tokens of one sequence, kv head): rows are (token, head of the group)."""
    tile, h = tl.program_id(0), tl.program_id(1)
    seq = tl.load(TILE_SEQ + tile)
    row0 = tl.load(TILE_ROW + tile)  # flattened row of the tile's first token
    pos0 = tl.load(TILE_POS + tile)  # its position
    n_tok = tl.load(TILE_N + tile)
    offs_m = tl.arange(0, BLOCK_M)
    t = offs_m // G
    head = h * G + offs_m % G
    row_live = t < n_tok
    pos = pos0 + t
    q = tl.load(Q + (row0 + t)[:, None] * stride_qt + head[:, None] * stride_qh + tl.arange(0, D)[None, :],
                mask=row_live[:, None], other=0.0)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    pos_last = pos0 + n_tok - 1
    # the first key any row of the tile sees (keys below a sequence's lo are released: never read)
    first = tl.maximum(tl.maximum(tl.load(LO_SEQ + seq), pos0 - window + 1), 0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for n0 in range(first // BLOCK_N * BLOCK_N, pos_last + 1, BLOCK_N):
        key = n0 + offs_n
        key_live = (key >= first) & (key <= pos_last)
        page = tl.load(BT + seq * stride_bt + key // TPB, mask=key_live, other=0).to(tl.int64)
        off = page * stride_ks + (key % TPB) * stride_kt + h * stride_kh
        k = tl.load(K + off[:, None] + offs_d[None, :], mask=key_live[:, None], other=0.0).to(q.dtype)
        qk = dot(q, tl.trans(k), IEEE)
        visible = (key[None, :] <= pos[:, None]) & (key[None, :] > pos[:, None] - window) & key_live[None, :]
        qk = tl.where(visible, qk * sm_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(qk - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + off[:, None] + offs_d[None, :], mask=key_live[:, None], other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, IEEE)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None] * v_scale
    tl.store(OUT + (row0 + t)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             out.to(OUT.dtype.element_ty), mask=row_live[:, None])


def decode_splits(batch: int, kv_heads: int, num_sms: int) -> int:
    """Splits per sequence so that about 4 programs per multiprocessor run (a power of two, <= 64)."""
    want = max(1, math.ceil(4 * num_sms / max(1, batch * kv_heads)))
    return min(64, 1 << (want - 1).bit_length())


def _strides(k: torch.Tensor) -> tuple[int, int, int]:
    if k.stride(3) != 1:
        raise ValueError(f"KV view must have unit stride on head_dim, got strides {k.stride()}")
    return k.stride(0), k.stride(1), k.stride(2)


def paged_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, lo: torch.Tensor, out: torch.Tensor, scale: float, splits: int,
                 scratch: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                 k_scale: float = 1.0, v_scale: float = 1.0, block_n: int = DECODE_BLOCK_N) -> torch.Tensor:
    """q [B, H, D] (any row/head strides), block_table [B, NB] int32, seq_lens / lo [B] int32 ->
    out [B, H, D]. `scratch`: preallocated (partials [B*KVH*splits*GP, D] f32, m, l) for graphs.
    `k_scale`, `v_scale`: an FP8 cache's layer scales (K, V are stored divided by them). `block_n`:
    keys per inner step (scripts/bench_decode_kernel.py times the choices)."""
    b, heads, d = q.shape
    kv_heads = k.shape[2]
    g = heads // kv_heads
    gp = group_rows(heads, kv_heads)
    partials, maxes, sums = scratch or decode_scratch(b, kv_heads, gp, d, splits, q.device)
    ks, kt, kh = _strides(k)
    if v.stride() != k.stride():
        raise ValueError("K and V views must have the same strides")
    _decode_split[(b, kv_heads, splits)](
        q, k, v, block_table, seq_lens, lo, partials, maxes, sums,
        q.stride(0), q.stride(1), ks, kt, kh, block_table.stride(0), scale * k_scale * LOG2E,
        KVH=kv_heads, G=g, GP=gp, D=d, TPB=k.shape[1], NSPLIT=splits, BLOCK_N=block_n,
        IEEE=q.dtype == torch.float32, FP16_DOT=fp16_dot(q, k), num_warps=4, num_stages=2)
    _decode_merge[(b, heads)](partials, maxes, sums, out, out.stride(0), out.stride(1), v_scale, KVH=kv_heads, G=g,
                              GP=gp, D=d, NSPLIT=splits, SP=max(2, triton.next_power_of_2(splits)), num_warps=4)
    return out


def fp16_dot(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether the decode kernel multiplies in float16: an FP8 cache under bf16 queries (`_decode_split`)."""
    return k.dtype == torch.float8_e4m3fn and q.dtype == torch.bfloat16


def decode_scratch(batch: int, kv_heads: int, gp: int, d: int, splits: int,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows = batch * kv_heads * splits * gp
    return (torch.empty(rows, d, dtype=torch.float32, device=device),
            torch.empty(rows, dtype=torch.float32, device=device),
            torch.empty(rows, dtype=torch.float32, device=device))


def group_rows(num_heads: int, kv_heads: int) -> int:
    """Padded query rows per kv head in a decode tile (tl.dot needs at least 16)."""
    return max(16, triton.next_power_of_2(num_heads // kv_heads))


def prefill_tokens_per_tile(num_heads: int, kv_heads: int) -> int:
    return max(1, PREFILL_BLOCK_M // (num_heads // kv_heads))


def paged_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  block_table: torch.Tensor, tiles: torch.Tensor, lo_seq: torch.Tensor, scale: float,
                  window: int, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """q, out [T, H, D]; block_table [S, NB] int32; tiles [4, num_tiles] int32 rows (sequence, first
    flattened row, first position, tokens); lo_seq [S] int32: first key held per sequence.
    `k_scale`, `v_scale`: an FP8 cache's layer scales."""
    heads, d = q.shape[1], q.shape[2]
    kv_heads = k.shape[2]
    ks, kt, kh = _strides(k)
    num_tiles = tiles.shape[1]
    _prefill[(num_tiles, kv_heads)](
        q, k, v, out, block_table, tiles[0], tiles[1], tiles[2], tiles[3], lo_seq,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), ks, kt, kh, block_table.stride(0),
        scale * k_scale * LOG2E, v_scale, window, G=heads // kv_heads, D=d, TPB=k.shape[1], BLOCK_M=PREFILL_BLOCK_M,
        BLOCK_N=PREFILL_BLOCK_N, IEEE=q.dtype == torch.float32, num_warps=4, num_stages=2)
    return out
