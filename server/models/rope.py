"""Rotary position embedding, numerically as transformers computes it.

Inverse frequencies come from transformers' `ROPE_INIT_FUNCTIONS` for scaled rope types and from the
original formula for "default". cos/sin are built once per step from the positions and shared by
all layers; the attention backend rotates q and k with them (`apply_rotary` or a fused kernel).
With a partial rotary factor (GLM-4.5) cos/sin span the first `spec.rotary_dim` dims of a head, which
are rotated as a head of that size; the others pass through unchanged, as transformers does.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from server.models.model_spec import ModelSpec, rope_parameters


def inv_freq_and_scaling(spec: ModelSpec, device: torch.device) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim // 2] float32, attention_scaling) for the model's rope type (transformers'
    scaled rope functions read the partial rotary factor themselves)."""
    cfg: PretrainedConfig = spec.hf_config
    if spec.rope_type == "default":
        base = rope_parameters(cfg)["rope_theta"]
        dim = spec.rotary_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim))
        return inv_freq.to(device), 1.0
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[spec.rope_type](cfg, device)
    return inv_freq.to(device=device, dtype=torch.float32), float(scaling)


class Rotary:
    """cos/sin for explicit positions (applied to the q and k heads of a step by the backend)."""

    def __init__(self, spec: ModelSpec, device: torch.device) -> None:
        inv_freq, scaling = inv_freq_and_scaling(spec, device)  # [rotary_dim // 2] float32
        self.inv_freq = torch.cat((inv_freq, inv_freq))  # [rotary_dim]: HF's emb = cat(freqs, freqs)
        half = inv_freq.shape[0]
        # rotate_half's sign (-1 on the first half) and the attention scaling, folded into one factor
        self.sin_factor = torch.tensor([-scaling] * half + [scaling] * half, device=device)
        self.cos_factor = scaling

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 -> cos, signed sin, each [T, rotary_dim] in `dtype`: HF's cos/sin with
        the first half of sin negated (see `apply_rotary`)."""
        emb = positions[:, None].float() * self.inv_freq  # [T, rotary_dim] float32
        cos = emb.cos() if self.cos_factor == 1.0 else emb.cos() * self.cos_factor
        sin = emb.sin() * self.sin_factor  # x * -s == -(x * s) exactly
        return cos.to(dtype), sin.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim], rotated by position: HF's x * cos + rotate_half(x) * sin on the first
    r = cos.shape[-1] dims of each head, the dims after them unchanged (a partial rotary factor).

    rotate_half(x) = cat(-x2, x1) equals the swapped halves cat(x2, x1) times (-1, +1), and `cos_sin`
    folded that sign into sin, so this is x * cos + swap(x) * signed_sin: the same products, exactly."""
    t, n, d = x.shape
    r = cos.shape[-1]
    if r < d:
        return torch.cat((apply_rotary(x[..., :r], cos, sin), x[..., r:]), -1)
    swapped = x.reshape(t, n, 2, d // 2).flip(2).reshape(t, n, d)
    return x * cos[:, None] + swapped * sin[:, None]


def apply_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, r] rotated as DeepSeek's attention does (its `rope_interleave`): rotate_half over the
    even and the odd dims, the result as the two halves (HF de-interleaves first); `sin` signed as
    `cos_sin` gives it (its second half is +sin)."""
    half = x.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, half:]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)
