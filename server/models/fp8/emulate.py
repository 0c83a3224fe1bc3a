"""The GPU's FP8 numerics on any device, in plain torch: `W8A8TorchOps` is `TorchOps` whose FP8 linears
round their activations to FP8 per token as the GPU's FP8 GEMMs do (`weight.w8a8_linear`), where the
CPU's serving path (`TorchOps`) multiplies the dequantized weight with the activations as they are.

The accuracy script runs a model with it to say, on a CPU, what the GPU's FP8 path costs
(pdserve_bench/fp8_accuracy.py); it is applied from outside, as `runner.model.ops = W8A8TorchOps(eps)`.
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
