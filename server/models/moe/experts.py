"""The routed experts' computation, two torch implementations of transformers' eager math (expert by
expert, accumulated in expert order): `grouped_experts` gathers each expert's tokens (the top-k's work
only, but it reads the counts on the host: the CPU's path); `dense_experts` runs every expert over
every token, weighting the others by zero (E / top_k times the work, but no host synchronisation:
the GPU's torch path, inside CUDA graphs). FP8 experts run dequantized to float32.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from server.models.fp8.weight import Fp8Weight, dequantized_linear

Weight = torch.Tensor | Fp8Weight
# (x [T, hidden], gate_up [E, 2I, hidden], down [E, hidden, I], weights [T, k] float32, ids [T, k]) -> [T, hidden];
# an id E names no expert held here (expert parallelism: another rank's) and contributes nothing
ExpertsFn = Callable[[torch.Tensor, Weight, Weight, torch.Tensor, torch.Tensor], torch.Tensor]


def _linear(x: torch.Tensor, w: Weight) -> torch.Tensor:
    return dequantized_linear(x, w, None) if isinstance(w, Fp8Weight) else F.linear(x, w)


def _pick(w: Weight, e: int) -> Weight:
    return w.expert(e) if isinstance(w, Fp8Weight) else w[e]


def _expert(x: torch.Tensor, gate_up: Weight, down: Weight) -> torch.Tensor:
    """One expert's MLP: x [N, hidden], gate_up [2I, hidden], down [hidden, I] -> [N, hidden]."""
    gate, up = _linear(x, gate_up).chunk(2, dim=-1)
    return _linear(F.silu(gate) * up, down)


def grouped_experts(x: torch.Tensor, gate_up: Weight, down: Weight, weights: torch.Tensor,
                    ids: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(x)
    order = ids.flatten().argsort(stable=True)  # [T * k] (token, slot) pairs grouped by expert
    num_experts = gate_up.shape[0]
    counts = torch.bincount(ids.flatten(), minlength=num_experts).tolist()  # host sync: the CPU's path
    tokens = order // ids.shape[1]
    scale = weights.flatten()[order]
    start = 0
    for expert, count in enumerate(counts[:num_experts]):  # (pairs of id E sort last: skipped)
        if count:
            rows = tokens[start:start + count]
            y = _expert(x.index_select(0, rows), _pick(gate_up, expert), _pick(down, expert))
            y = y * scale[start:start + count, None]
            out.index_add_(0, rows, y.to(out.dtype))
            start += count
    return out


def dense_experts(x: torch.Tensor, gate_up: Weight, down: Weight, weights: torch.Tensor,
                  ids: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(x)
    for expert in range(gate_up.shape[0]):
        scale = (weights * (ids == expert)).sum(dim=-1, keepdim=True)  # [T, 1]: 0 where not routed
        out += (_expert(x, _pick(gate_up, expert), _pick(down, expert)) * scale).to(out.dtype)
    return out


def default_experts(device: torch.device) -> ExpertsFn:
    """The torch implementation for `device`: grouped on the CPU, dense (graph-safe) on CUDA."""
    return dense_experts if device.type == "cuda" else grouped_experts


def expert_load(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """ids [T, k] -> tokens routed to each expert [num_experts] int64, on the device (no sync)."""
    flat = ids.flatten()
    return torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
