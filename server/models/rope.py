"""Rotary position embedding, numerically as transformers computes it.

Inverse frequencies come from transformers' `ROPE_INIT_FUNCTIONS` for every scaled rope type, and
from the original formula for "default", so each variant matches HF exactly. cos/sin are built
once per step from the explicit positions and shared by all layers.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from server.models.spec import ModelSpec, rope_parameters


def inv_freq_and_scaling(spec: ModelSpec, device: torch.device) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim // 2] float32, attention_scaling) for the model's rope type."""
    cfg: PretrainedConfig = spec.hf_config
    if spec.rope_type == "default":
        base = rope_parameters(cfg)["rope_theta"]
        dim = spec.head_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim))
        return inv_freq.to(device), 1.0
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[spec.rope_type](cfg, device)
    return inv_freq.to(device=device, dtype=torch.float32), float(scaling)


class Rotary:
    """cos/sin for explicit positions and their application to q and k."""

    def __init__(self, spec: ModelSpec, device: torch.device) -> None:
        self.inv_freq, self.scaling = inv_freq_and_scaling(spec, device)  # [head_dim // 2]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 -> cos, sin each [T, 1, head_dim] in `dtype` (broadcast over heads)."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # [T, head_dim // 2] float32
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        cos, sin = emb.cos(), emb.sin()
        if self.scaling != 1.0:
            cos, sin = cos * self.scaling, sin * self.scaling
        return cos.to(dtype), sin.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] rotated by position: x * cos + rotate_half(x) * sin (HF's formula)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
