"""FP8 (e4m3) linear weights: the stored form, quantization, and the plain torch references.

`Fp8Weight` holds W [N, K] as float8 `qweight` and one float32 scale per output row (a checkpoint's
per-tensor scale expanded to its rows, exactly, so q/k/v and gate/up fuse row by row: `cat_rows`),
or per row and block of `block_k` columns (`from_block_checkpoint`). `dequantized_linear` is the CPU's serving
path (exactly what the dequantized checkpoint computes); `w8a8_linear` is what the GPU computes
(activations quantized per row, fp8/linear.py): the Triton kernels' reference, and the accuracy
script's emulation of the GPU on a CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3 (fn) value
MIN_AMAX = 1e-12  # an all-zero row gets this amax: its scale stays finite and its values 0


@dataclass(frozen=True)
class Fp8Weight:
    qweight: torch.Tensor  # [N, K] (stacked experts: [E, N, K]) float8_e4m3fn, contiguous
    scale: torch.Tensor  # [N] ([E, N]) float32: row n of the weight is qweight[n] * scale[n]
    input_scale: torch.Tensor | None = None  # [1] float32: a checkpoint's static activation scale
    block_k: int = 0  # > 0: scale is [(E,) N, ceil(K / block_k)], per row and block of block_k columns

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    def nbytes(self) -> int:
        extra = 0 if self.input_scale is None else self.input_scale.numel() * 4
        return self.qweight.numel() + self.scale.numel() * 4 + extra

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight it stands for, [N, K] or [E, N, K] (computed in float32, then cast)."""
        if self.block_k:
            k = self.qweight.shape[-1]
            return (self.qweight.float() * self.scale.repeat_interleave(self.block_k, dim=-1)[..., :k]).to(dtype)
        return (self.qweight.float() * self.scale[..., None]).to(dtype)

    def with_blocks(self, block_k: int) -> Fp8Weight:
        """The same weight with one scale per row and block of block_k columns (exact)."""
        if self.block_k == block_k:
            return self
        if self.block_k:
            raise ValueError(f"FP8 weights of column blocks {self.block_k} and {block_k} cannot be fused")
        blocks = -(-self.qweight.shape[-1] // block_k)
        scale = self.scale[..., None].expand(*self.scale.shape, blocks).contiguous()
        return Fp8Weight(self.qweight, scale, self.input_scale, block_k)

    def expert(self, e: int) -> Fp8Weight:
        """Expert e's [N, K] weight of stacked experts (views)."""
        return Fp8Weight(self.qweight[e], self.scale[e], self.input_scale, self.block_k)


def quantize_weight(weight: torch.Tensor) -> Fp8Weight:
    """Per output row: scale[n] = max|W[n]| / 448, qweight = W / scale rounded to e4m3 (to nearest, ties
    to even). On the weight's device. W [N, K], or stacked experts [E, N, K] (per expert and row)."""
    w = weight.float()
    scale = w.abs().amax(dim=-1).clamp_min(MIN_AMAX) / FP8_MAX
    q = (w / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return Fp8Weight(q.contiguous(), scale.contiguous())


def from_checkpoint(qweight: torch.Tensor, scale: torch.Tensor, input_scale: torch.Tensor | None,
                    name: str) -> Fp8Weight:
    """A checkpoint's float8 weight with its scale: one value (per tensor) or one per output row
    ([N] or [N, 1]: per channel). Other shapes (block-wise scales) raise a ValueError naming `name`."""
    check_matrix(qweight, name)
    n = qweight.shape[0]
    if scale.numel() not in (1, n) or (scale.dim() == 2 and scale.shape[1] != 1) or scale.dim() > 2:
        raise ValueError(f"weight {name!r}: an FP8 scale of shape {tuple(scale.shape)} for a weight of shape "
                         f"{tuple(qweight.shape)}: only per-tensor and per-channel (one per output row) scales "
                         "are supported, not block-wise ones")
    if input_scale is not None and input_scale.numel() != 1:
        raise ValueError(f"weight {name!r}: input_scale must be one value (per tensor), got shape "
                         f"{tuple(input_scale.shape)}")
    rows = scale.float().reshape(-1).expand(n).contiguous()
    static = None if input_scale is None else input_scale.float().reshape(1).contiguous()
    return Fp8Weight(qweight.contiguous(), rows, static)


def from_block_checkpoint(qweight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], name: str) -> Fp8Weight:
    """A block-scaled checkpoint's float8 weight [N, K] (`quant_method: fp8`, `weight_block_size: [128, 128]`,
    as DeepSeek-V3 and Qwen3-FP8 ship) and its float32 `*.weight_scale_inv` [ceil(N / rows), ceil(K /
    columns)], a multiplier despite its name; a ValueError naming `name` for any other shape. The row
    blocks expand to their rows (exact), so such weights fuse and stack row by row as per-channel ones
    do. The CPU runs them dequantized; the GPU runs kernels/fp8_blocks.py (linears) and kernels/moe.py
    (experts), which read the float8 weight once and scale each column block's partial sum."""
    check_matrix(qweight, name)
    (n, k), (bn, bk) = qweight.shape, block
    want = (-(-n // bn), -(-k // bk))
    if tuple(scale.shape) != want:
        raise ValueError(f"weight {name!r}: a block scale of shape {tuple(scale.shape)} for a weight of shape "
                         f"{(n, k)} in blocks of {list(block)}: want {want}")
    rows = scale.float().repeat_interleave(bn, dim=0)[:n].contiguous()
    return Fp8Weight(qweight.contiguous(), rows, None, bk)


def check_matrix(qweight: torch.Tensor, name: str) -> None:
    if qweight.dtype != FP8 or qweight.dim() != 2:
        raise ValueError(f"weight {name!r}: {qweight.dtype} {tuple(qweight.shape)}: an FP8 linear weight must be "
                         "a float8_e4m3fn matrix")


def cat_rows(parts: list[torch.Tensor] | list[Fp8Weight]) -> torch.Tensor | Fp8Weight:
    """Fuse weights along their output rows (q|k|v, gate|up), as `fuse` says."""
    return fuse(parts, torch.cat)


def stack_experts(parts: list[torch.Tensor] | list[Fp8Weight]) -> torch.Tensor | Fp8Weight:
    """Each routed expert's [N, K] weight -> [E, N, K], as `fuse` says (a static checkpoint's input
    scale per projection: the largest of its experts'). The CPU serves FP8 experts dequantized."""
    return fuse(parts, lambda tensors: torch.stack(tensors).contiguous())


def fuse(parts: list[torch.Tensor] | list[Fp8Weight], join) -> torch.Tensor | Fp8Weight:
    """`join` (torch.cat along rows, or a stack of experts) of float or FP8 parts. FP8 parts keep
    their rows' scales (exact); the fused static input scale is the largest of the parts' (they read
    the same input). Mixed parts (some left in float) are all dequantized to the float parts' dtype."""
    fp8 = [p for p in parts if isinstance(p, Fp8Weight)]
    if not fp8:
        return join(parts)
    if len(fp8) < len(parts):
        dtype = next(p.dtype for p in parts if isinstance(p, torch.Tensor))
        return join([p.dequantize(dtype) if isinstance(p, Fp8Weight) else p for p in parts])
    block_k = max(p.block_k for p in fp8)  # all per row, or all per row and column block where one is (exact)
    fp8 = [p.with_blocks(block_k) for p in fp8] if block_k else fp8
    statics = [p.input_scale for p in fp8]
    static = None if any(s is None for s in statics) else torch.stack(statics).amax(0)
    return Fp8Weight(join([p.qweight for p in fp8]), join([p.scale for p in fp8]), static, block_k)


def row_scales(x: torch.Tensor, static: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row activation scales of x [M, K], as the Triton kernel computes them: (xs [M], x[m] ~ xq[m] *
    xs[m]; inv [M], what x is multiplied by before rounding), from max|x[m]| / 448 or `static`."""
    if static is not None:
        s = static.float().reshape(1).expand(x.shape[0])
        return s.contiguous(), (1.0 / s).contiguous()
    amax = x.float().abs().amax(dim=1).clamp_min(MIN_AMAX)
    return amax / FP8_MAX, FP8_MAX / amax


def quantize_rows(x: torch.Tensor, static: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (xq [M, K] float8_e4m3fn, xs [M] float32), x[m] ~ xq[m] * xs[m]."""
    xs, inv = row_scales(x, static)
    return (x.float() * inv[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), xs


def scaled_output(acc: torch.Tensor, xs: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                  dtype: torch.dtype) -> torch.Tensor:
    """The epilogue every FP8 path shares: acc [M, N] float32 -> acc * xs[m] * scale[n] (+ bias), one rounding."""
    out = acc * xs[:, None] * scale[None, :]
    if bias is not None:
        out = out + bias.float()
    return out.to(dtype)


def w8a8_linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """What the GPU computes (module docstring), in float32 torch: x [M, K] -> [M, N] in x's dtype.
    (A block-scaled weight: the quantized rows times the dequantized weight.)"""
    xq, xs = quantize_rows(x, w.input_scale)
    if w.block_k:
        acc = xq.float() @ w.dequantize(torch.float32).t()
        return scaled_output(acc, xs, torch.ones(w.shape[0], device=x.device), bias, x.dtype)
    acc = xq.float() @ w.qweight.float().t()
    return scaled_output(acc, xs, w.scale, bias, x.dtype)


def dequantized_linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """The CPU's FP8 linear: F.linear in float32 with the weight dequantized, cast to x's dtype."""
    b = None if bias is None else bias.float()
    return F.linear(x.float(), w.dequantize(torch.float32), b).to(x.dtype)
