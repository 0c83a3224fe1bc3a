"""Triton decode over a latent (MLA) cache: one row a token and layer, [c (R values), k_pe (P)].

With the up-projections absorbed a head's query is [q_c (R), q_pe (P)], its scores q_c . c + q_pe .
k_pe and its output the softmax-weighted sum of `c`: every head reads the same keys, so a program
takes one (sequence, split) with all heads as the rows of its tiles, reads each key row once and
writes softmax partials that `kernels.attention._decode_merge` combines (one kv head, D = R). Every
index is a device tensor and the grids depend only on host-known sizes: CUDA-graph capturable.
R and P must be powers of two (DeepSeek-V2/V3: 512 and 64).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from server.models.kernels.attention import LOG2E, _decode_merge, decode_scratch, dot, group_rows, split_range

LATENT_BLOCK_N = 32  # keys per inner step: a [32, R] tile of c and the [heads, R] accumulator


@triton.jit(do_not_specialize=["stride_bt"])
def _latent_split(Q, C, BT, SEQ, LO, OP, MP, LP, stride_qt, stride_qh, stride_cs, stride_ct, stride_bt,
                  sm_scale_log2, G: tl.constexpr, GP: tl.constexpr, R: tl.constexpr, P: tl.constexpr,
                  TPB: tl.constexpr, NSPLIT: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """One (sequence, split): softmax partials of every head over the split's keys."""
    b, s = tl.program_id(0), tl.program_id(1)
    start, end = split_range(SEQ, LO, b, s, NSPLIT, BLOCK_N)
    offs_g, offs_r, offs_p, offs_n = tl.arange(0, GP), tl.arange(0, R), tl.arange(0, P), tl.arange(0, BLOCK_N)
    rows = Q + b * stride_qt + offs_g[:, None] * stride_qh
    q_c = tl.load(rows + offs_r[None, :], mask=(offs_g < G)[:, None], other=0.0)
    q_p = tl.load(rows + R + offs_p[None, :], mask=(offs_g < G)[:, None], other=0.0)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, R], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        tok = n0 + offs_n
        live = tok < end
        page = tl.load(BT + b * stride_bt + tok // TPB, mask=live, other=0).to(tl.int64)
        row = C + page * stride_cs + (tok % TPB) * stride_ct
        c = tl.load(row[:, None] + offs_r[None, :], mask=live[:, None], other=0.0).to(q_c.dtype)
        k_pe = tl.load(row[:, None] + R + offs_p[None, :], mask=live[:, None], other=0.0).to(q_c.dtype)
        qk = dot(q_c, tl.trans(c), IEEE) + dot(q_p, tl.trans(k_pe), IEEE)
        qk = tl.where(live[None, :], qk * sm_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + dot(p.to(c.dtype), c, IEEE)
        m_i = m_new
    base = (b * NSPLIT + s) * GP
    tl.store(OP + (base + offs_g)[:, None] * R + offs_r[None, :], acc)
    tl.store(MP + base + offs_g, m_i)
    tl.store(LP + base + offs_g, l_i)


@triton.jit
def _write_rows(X, CACHE, SLOT, OFF, stride_xt, stride_cs, stride_ct, W: tl.constexpr, WP: tl.constexpr):
    """Row t of X into the cache at (SLOT[t], OFF[t]); a padding row (slot -1) writes nothing."""
    t = tl.program_id(0)
    slot = tl.load(SLOT + t)
    if slot >= 0:
        offs = tl.arange(0, WP)
        value = tl.load(X + t * stride_xt + offs, mask=offs < W)
        where = CACHE + slot.to(tl.int64) * stride_cs + tl.load(OFF + t) * stride_ct + offs
        tl.store(where, value.to(CACHE.dtype.element_ty), mask=offs < W)


def write_latent(latent: torch.Tensor, cache: torch.Tensor, slot: torch.Tensor, offset: torch.Tensor) -> None:
    """latent [T, W] -> cache [slots, tpb, W] at slot[t], offset[t] (int32; slot -1: skipped)."""
    width = latent.shape[1]
    _write_rows[(latent.shape[0],)](latent, cache, slot, offset, latent.stride(0), cache.stride(0), cache.stride(1),
                                    W=width, WP=triton.next_power_of_2(width), num_warps=4)


def latent_decode(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                  lo: torch.Tensor, out: torch.Tensor, scale: float, splits: int,
                  scratch: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """q [B, H, R + P] (unit stride on the last dim), cache [slots, tpb, R + P], block_table [B, NB],
    seq_lens / lo [B] int32 -> out [B, H, R]. `scratch`: graphs' (partials [B*splits*GP, R] f32, m, l)."""
    b, heads, width = q.shape
    rank = out.shape[2]
    gp = group_rows(heads, 1)
    partials, maxes, sums = scratch or decode_scratch(b, 1, gp, rank, splits, q.device)
    if cache.stride(2) != 1 or q.stride(2) != 1:
        raise ValueError(f"latent decode needs unit strides on the row: q {q.stride()}, cache {cache.stride()}")
    _latent_split[(b, splits)](
        q, cache, block_table, seq_lens, lo, partials, maxes, sums, q.stride(0), q.stride(1), cache.stride(0),
        cache.stride(1), block_table.stride(0), scale * LOG2E, G=heads, GP=gp, R=rank, P=width - rank,
        TPB=cache.shape[1], NSPLIT=splits, BLOCK_N=LATENT_BLOCK_N, IEEE=q.dtype == torch.float32,
        num_warps=8, num_stages=2)
    _decode_merge[(b, heads)](partials, maxes, sums, out, out.stride(0), out.stride(1), 1.0, KVH=1, G=heads,
                              GP=gp, D=rank, NSPLIT=splits, SP=max(2, triton.next_power_of_2(splits)), num_warps=4)
    return out


@triton.jit
def _latent_rope(Q, KV, COS, SIN, stride_qt, stride_qh, stride_kv, stride_c, q_off, kv_off,
                 H: tl.constexpr, ROWS: tl.constexpr, HALF: tl.constexpr, INTERLEAVE: tl.constexpr):
    """Program (token, block of ROWS rows): rotate in place the rope dims of its query heads (from column
    q_off of each) and of its shared key (row H: from column kv_off of its kv_a row), as transformers'
    DeepSeek attention: rotate_half over the two halves, or (INTERLEAVE) over the even and the odd dims,
    the result written as the two halves. Each product and sum rounds to the model dtype as torch's ops do."""
    t = tl.program_id(0)
    rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)[:, None]
    i = tl.arange(0, HALF)[None, :]
    live = (rows <= H) & (i < HALF)
    base = tl.where(rows < H, Q + t.to(tl.int64) * stride_qt + rows * stride_qh + q_off,
                    KV + t.to(tl.int64) * stride_kv + kv_off)
    if INTERLEAVE:
        x1 = tl.load(base + 2 * i, mask=live, other=0.0)
        x2 = tl.load(base + 2 * i + 1, mask=live, other=0.0)
    else:
        x1 = tl.load(base + i, mask=live, other=0.0)
        x2 = tl.load(base + HALF + i, mask=live, other=0.0)
    dt = x1.dtype
    c1 = tl.load(COS + t * stride_c + i).to(tl.float32)
    c2 = tl.load(COS + t * stride_c + HALF + i).to(tl.float32)
    s1 = tl.load(SIN + t * stride_c + i).to(tl.float32)  # signed: rotate_half's minus (rope.py `cos_sin`)
    s2 = tl.load(SIN + t * stride_c + HALF + i).to(tl.float32)
    a1 = (x1.to(tl.float32) * c1).to(dt).to(tl.float32)
    if INTERLEAVE:  # (x1 c - x2 s, x2 c + x1 s), c the first half of cos, s = +sin: the signed sin's second half
        a2 = (x2.to(tl.float32) * c1).to(dt).to(tl.float32)
        y1 = a1 - (x2.to(tl.float32) * s2).to(dt).to(tl.float32)
    else:
        a2 = (x2.to(tl.float32) * c2).to(dt).to(tl.float32)
        y1 = a1 + (x2.to(tl.float32) * s1).to(dt).to(tl.float32)
    y2 = a2 + (x1.to(tl.float32) * s2).to(dt).to(tl.float32)
    tl.debug_barrier()  # every lane's loads before any store (interleaved: a lane stores what another read)
    tl.store(base + i, y1.to(dt), mask=live)
    tl.store(base + HALF + i, y2.to(dt), mask=live)


def latent_rope(q: torch.Tensor, kv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> None:
    """q [T, heads, nope + P] (unit last stride), kv [T, R + P] (kv_a's output: c then k_pe), cos and the
    signed sin [T, P]: q's last P dims of each head and kv's last P rotated in place (`_latent_rope`)."""
    t, heads, width = q.shape
    rope = cos.shape[-1]
    if t:
        rows = min(16, triton.next_power_of_2(heads + 1))  # (DeepSeek-V3's 128 heads: 9 blocks of a token)
        _latent_rope[(t, triton.cdiv(heads + 1, rows))](
            q, kv, cos, sin, q.stride(0), q.stride(1), kv.stride(0), cos.stride(0), width - rope, kv.shape[1] - rope,
            H=heads, ROWS=rows, HALF=rope // 2, INTERLEAVE=interleave, num_warps=4)
