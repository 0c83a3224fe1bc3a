"""The GPU's FP8 numerics in plain torch: `W8A8TorchOps` rounds an FP8 linear's activations per token
(`weight.w8a8_linear`) where `TorchOps` uses them as they are. pdserve_bench/fp8_accuracy.py sets
`runner.model.ops = W8A8TorchOps(eps)` to measure, on a CPU, what the GPU's FP8 path costs.
"""

from __future__ import annotations

import torch

from server.models.fp8.weight import Fp8Weight, w8a8_linear
from server.models.ops import TorchOps, Weight


class W8A8TorchOps(TorchOps):
    def linear(self, x: torch.Tensor, weight: Weight, bias: torch.Tensor | None) -> torch.Tensor:
        if isinstance(weight, Fp8Weight):
            return w8a8_linear(x, weight, bias)
        return super().linear(x, weight, bias)
