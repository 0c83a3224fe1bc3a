"""The grouped FP8 expert kernels' (server/models/kernels/moe.py `fused_fp8_experts`) torch reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from server.models.fp8.weight import Fp8Weight, w8a8_linear


def w8a8_experts(x: torch.Tensor, gate_up: Fp8Weight, down: Fp8Weight, weights: torch.Tensor,
                 ids: torch.Tensor) -> torch.Tensor:
    """The grouped FP8 kernels' result in torch (`experts.ExpertsFn` contract): per expert, h =
    silu(gate) * up of `w8a8_linear(x, gate|up)`, then `w8a8_linear(h, down)` times the routing
    weight; the pairs summed per token in slot order (a static checkpoint's input scale per
    projection is the largest of its experts', as `stack_experts` fuses it)."""
    t, k = ids.shape
    y = torch.zeros((t, k, x.shape[1]), dtype=x.dtype, device=x.device)
    for e in range(gate_up.shape[0]):
        token, slot = (ids == e).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        gate, up = w8a8_linear(x[token], gate_up.expert(e), None).chunk(2, dim=-1)
        h = (F.silu(gate) * up).to(x.dtype)
        out = w8a8_linear(h, down.expert(e), None).float() * weights[token, slot, None]
        y[token, slot] = out.to(x.dtype)
    return y.sum(dim=1)
