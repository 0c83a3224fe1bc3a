"""Fused Triton kernels for the steps between GEMMs: RMSNorm (+ residual add; per head of q and k),
SiLU-and-mul, and RoPE fused with the KV cache write (into an FP8 cache: K / k_scale and V / v_scale as
e4m3), over a head's first rotary_dim dims (all of them but with a partial rotary factor).

Each rounds where transformers' modules round (compute in float32, round each op's result to the
model dtype), so bf16 results match them op for op; float32 models round nowhere.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _normed(xf, var, w, eps, dt: tl.constexpr):
    """RMSNorm's output from x (float32) and its mean square `var`, rounded as LlamaRMSNorm rounds: the
    normalised x to the model dtype `dt`, then times the weight, rounded again."""
    return (w * (xf * tl.rsqrt(var + eps)).to(dt).to(tl.float32)).to(dt)


@triton.jit
def _rms_norm(X, RES, W, OUT, stride_x, stride_r, stride_o, n_cols, eps, BLOCK: tl.constexpr,
              ADD: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    live = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=live, other=0.0)
    if ADD:  # RES += X (rounded as a torch add), then normalise RES
        x = (tl.load(RES + row * stride_r + cols, mask=live, other=0.0).to(tl.float32) + x.to(tl.float32))
        x = x.to(RES.dtype.element_ty)
        tl.store(RES + row * stride_r + cols, x, mask=live)
    xf = x.to(tl.float32)
    w = tl.load(W + cols, mask=live, other=0.0).to(tl.float32)
    tl.store(OUT + row * stride_o + cols, _normed(xf, tl.sum(xf * xf, 0) / n_cols, w, eps, OUT.dtype.element_ty),
             mask=live)


@triton.jit
def _head_rms_norm(QKV, QW, KW, stride_t, eps, D: tl.constexpr, HEADS: tl.constexpr, NORMED: tl.constexpr,
                   ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """Program (token), its q and k heads as rows (NORMED of them, ROWS a power of two >= NORMED): each head
    RMS-normalised in place with QW (q heads) or KW (row >= HEADS: k heads), rounded as `_rms_norm` rounds."""
    t = tl.program_id(0)
    heads = tl.arange(0, ROWS)[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    live = (heads < NORMED) & (cols < D)
    at = QKV + t * stride_t + heads * D + cols
    x = tl.load(at, mask=live, other=0.0)
    xf = x.to(tl.float32)
    wq = tl.load(QW + cols, mask=cols < D, other=0.0).to(tl.float32)
    wk = tl.load(KW + cols, mask=cols < D, other=0.0).to(tl.float32)
    tl.store(at, _normed(xf, (tl.sum(xf * xf, 1) / D)[:, None], tl.where(heads < HEADS, wq, wk), eps, x.dtype),
             mask=live)


@triton.jit
def _silu_mul(GU, OUT, stride_g, stride_o, n_cols, BLOCK: tl.constexpr):
    row, part = tl.program_id(0), tl.program_id(1)
    cols = part * BLOCK + tl.arange(0, BLOCK)
    live = cols < n_cols
    gate = tl.load(GU + row * stride_g + cols, mask=live, other=0.0).to(tl.float32)
    up = tl.load(GU + row * stride_g + n_cols + cols, mask=live, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(OUT.dtype.element_ty).to(tl.float32)
    tl.store(OUT + row * stride_o + cols, (act * up).to(OUT.dtype.element_ty), mask=live)


@triton.jit
def e4m3_bits(x):
    """float32 -> the e4m3fn code (0..255, as int32) of x: round to nearest even, saturated at
    +-448, the rounding of torch's float32 -> float8_e4m3fn (kvcache.layout.quantize_fp8) bit for bit.
    In integer arithmetic, so compiled and interpreted kernels agree (Triton's interpreter rounds
    float8 conversions its own way)."""
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    # normal e4m3 (|x| >= 2^-6): keep float32's exponent and top 3 mantissa bits, round on the other
    # 20 (a carry moves into the exponent), rebias 127 -> 7
    m = a >> 20
    rem = a & 0xFFFFF
    m = m + ((rem > 0x80000) | ((rem == 0x80000) & ((m & 1) == 1))).to(tl.int32)
    normal = m - (120 << 3)
    # subnormal e4m3 (|x| < 2^-6): round |x| * 2^9 to an integer 0..8 (8 is the smallest normal)
    s = tl.minimum(141 - (a >> 23), 31)
    mant = (a & 0x7FFFFF) | 0x800000
    q = mant >> s
    r = mant & ((1 << s) - 1)
    half = 1 << (s - 1)
    q = q + ((r > half) | ((r == half) & ((q & 1) == 1))).to(tl.int32)
    return sign | tl.where(a >= 0x3C800000, normal, q)


@triton.jit
def _store_kv(dst, x, inv, live, QUANT: tl.constexpr):
    """Store part of a head of K or V (`live`: its lanes): as is, or (QUANT, `dst` bytes of an FP8
    cache) x * inv as e4m3."""
    if QUANT:
        tl.store(dst, e4m3_bits(x.to(tl.float32) * inv).to(tl.uint8), mask=live)
    else:
        tl.store(dst, x, mask=live)


@triton.jit
def _rope_write(QKV, COS, SIN, K, V, SLOT, OFF, stride_t, stride_c, stride_ks, stride_kt, stride_kh, k_inv, v_inv,
                H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, R: tl.constexpr, HALF: tl.constexpr,
                PASS: tl.constexpr, QK: tl.constexpr, VH: tl.constexpr, DP: tl.constexpr, QUANT: tl.constexpr):
    """Program (token), its heads as rows: rotate the first R dims of q and k in place (rotate_half over
    R; HALF = next power of two of R / 2 lanes) and write k and v to the cache; dims R..D of q and k
    pass through (PASS lanes, 0 when R == D). QK, VH, DP: powers of two >= H + KVH, KVH and D."""
    t = tl.program_id(0)
    row = QKV + t * stride_t
    slot = tl.load(SLOT + t)
    at = slot.to(tl.int64) * stride_ks + tl.load(OFF + t) * stride_kt  # the token's place in the cache
    heads = tl.arange(0, QK)[:, None]
    half = tl.arange(0, HALF)[None, :]
    lanes = half < R // 2
    live = (heads < H + KVH) & lanes
    base = row + heads * D
    x1 = tl.load(base + half, mask=live, other=0.0)
    x2 = tl.load(base + R // 2 + half, mask=live, other=0.0)
    dt = x1.dtype
    c1 = tl.load(COS + t * stride_c + half, mask=lanes, other=0.0).to(tl.float32)
    c2 = tl.load(COS + t * stride_c + R // 2 + half, mask=lanes, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + t * stride_c + half, mask=lanes, other=0.0).to(tl.float32)  # signed: rotate_half's minus
    s2 = tl.load(SIN + t * stride_c + R // 2 + half, mask=lanes, other=0.0).to(tl.float32)
    a1 = (x1.to(tl.float32) * c1).to(dt).to(tl.float32)
    b1 = (x2.to(tl.float32) * s1).to(dt).to(tl.float32)
    a2 = (x2.to(tl.float32) * c2).to(dt).to(tl.float32)
    b2 = (x1.to(tl.float32) * s2).to(dt).to(tl.float32)
    y1 = (a1 + b1).to(dt)
    y2 = (a2 + b2).to(dt)
    tl.store(base + half, y1, mask=live)  # q and k rotated in place (a dense prefill reads k from here)
    tl.store(base + R // 2 + half, y2, mask=live)
    if slot >= 0:  # slot -1: a padding row, nothing written
        is_k = (heads >= H) & (heads < H + KVH)
        dst = K + at + (heads - H) * stride_kh
        _store_kv(dst + half, y1, k_inv, live & is_k, QUANT)
        _store_kv(dst + R // 2 + half, y2, k_inv, live & is_k, QUANT)
        if PASS > 0:  # a partial rotary factor: the unrotated dims of k as they are
            rest = R + tl.arange(0, PASS)[None, :]
            kept = is_k & (rest < D)
            _store_kv(dst + rest, tl.load(base + rest, mask=kept, other=0.0), k_inv, kept, QUANT)
        vh = tl.arange(0, VH)[:, None]
        dims = tl.arange(0, DP)[None, :]
        vlive = (vh < KVH) & (dims < D)
        v = tl.load(row + (H + KVH + vh) * D + dims, mask=vlive, other=0.0)
        _store_kv(V + at + vh * stride_kh + dims, v, v_inv, vlive, QUANT)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [R, N] (unit column stride) -> RMSNorm(x) * weight, as transformers' LlamaRMSNorm; with
    `residual`: residual += x (in place), and RMSNorm(residual) * weight."""
    out = torch.empty_like(x)
    n = x.shape[-1]
    add, residual = residual is not None, x if residual is None else residual
    _rms_norm[(x.shape[0],)](x, residual, weight, out, x.stride(0), residual.stride(0), out.stride(0), n, eps,
                             BLOCK=triton.next_power_of_2(n), ADD=add, num_warps=4 if n <= 2048 else 8)
    return out


def qk_norm(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, heads: int, kv_heads: int,
            eps: float) -> None:
    """qkv [T, heads + 2 kv_heads, D] (heads contiguous): each q head and k head RMS-normalised in place
    (Qwen3's per-head q and k norms), one kernel."""
    t, _, d = qkv.shape
    if t:
        normed = heads + kv_heads
        _head_rms_norm[(t,)](qkv, q_weight, k_weight, qkv.stride(0), eps, D=d, HEADS=heads, NORMED=normed,
                             ROWS=triton.next_power_of_2(normed), BLOCK=triton.next_power_of_2(d), num_warps=4)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] -> silu(gate) * up [T, I]."""
    rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, n), dtype=gate_up.dtype, device=gate_up.device)
    block = min(2048, triton.next_power_of_2(n))
    _silu_mul[(rows, triton.cdiv(n, block))](gate_up, out, gate_up.stride(0), out.stride(0), n, BLOCK=block,
                                              num_warps=4)
    return out


def rope_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, slot: torch.Tensor, offset: torch.Tensor, num_heads: int,
               num_kv_heads: int, k_inv: float = 1.0, v_inv: float = 1.0) -> None:
    """qkv [T, H + 2 KVH, D] (heads contiguous): the first R dims of q and k rotated in place, k and v
    written to the cache at (slot[t], offset[t]) (int32; slot -1: padding, not written). cos, sin
    [T, R] (R <= D, even: a partial rotary factor rotates R < D dims). An FP8 cache gets
    e4m3(k * k_inv) and e4m3(v * v_inv) (the inverses of the layer's scales)."""
    t, heads, d = qkv.shape
    r = cos.shape[1]
    if qkv.stride(2) != 1 or qkv.stride(1) != d or k_cache.stride() != v_cache.stride():
        raise ValueError("rope_write needs heads laid out contiguously and K, V views with equal strides")
    ks, kt, kh = k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)
    quant = k_cache.dtype == torch.float8_e4m3fn
    if quant:  # the codes are computed in the kernel and stored as bytes
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    half, qk = triton.next_power_of_2(r // 2), triton.next_power_of_2(num_heads + num_kv_heads)
    _rope_write[(t,)](qkv, cos, sin, k_cache, v_cache, slot, offset, qkv.stride(0), cos.stride(0), ks, kt, kh,
                      k_inv, v_inv, H=num_heads, KVH=num_kv_heads, D=d, R=r, HALF=half,
                      PASS=triton.next_power_of_2(d - r) if r < d else 0, QK=qk,
                      VH=triton.next_power_of_2(num_kv_heads), DP=triton.next_power_of_2(d), QUANT=quant,
                      num_warps=4 if qk * half >= 1024 else 1)

