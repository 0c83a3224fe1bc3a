"""The SiLU-gated MLP of a decoder layer (and a MoE block's shared expert), weights fused at load.

A feed-forward block is called as `block(x, ops)` -> [T, hidden]: with tensor parallelism, a rank's
partial sum (its intermediate columns), which the model all-reduces (`ParallelContext.reduce`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from server.models.fp8.weight import cat_rows
from server.models.ops import TorchOps, Weight


class WeightSource(Protocol):
    """HF tensor names -> loaded tensors (the model's weight table)."""

    def take(self, name: str) -> Weight:
        """The tensor `name`; a ValueError naming it when the checkpoint lacks it."""

    def has(self, name: str) -> bool:
        """Whether the checkpoint holds `name`."""


class FeedForward(Protocol):
    def __call__(self, x: torch.Tensor, ops: TorchOps) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden] (a tensor-parallel rank's partial sum)."""


@dataclass
class DenseMLP:
    gate_up: Weight  # [2 * intermediate, hidden]: the gate rows, then the up rows
    gate_up_bias: torch.Tensor | None
    down: Weight  # [hidden, intermediate]
    down_bias: torch.Tensor | None

    def __call__(self, x: torch.Tensor, ops: TorchOps) -> torch.Tensor:
        gate_up = ops.linear(x, self.gate_up, self.gate_up_bias)
        return ops.linear(ops.silu_mul(gate_up), self.down, self.down_bias)


def load_mlp(w: WeightSource, prefix: str, *, bias: bool = False) -> DenseMLP:
    """The MLP whose projections are `{prefix}{gate,up,down}_proj.weight` (and `.bias` with `bias`)."""
    gate_up = [w.take(f"{prefix}{n}_proj.weight") for n in ("gate", "up")]
    gate_up_bias = [w.take(f"{prefix}{n}_proj.bias") for n in ("gate", "up")] if bias else None
    return DenseMLP(gate_up=cat_rows(gate_up), gate_up_bias=torch.cat(gate_up_bias) if gate_up_bias else None,
                    down=w.take(f"{prefix}down_proj.weight"),
                    down_bias=w.take(f"{prefix}down_proj.bias") if bias else None)
