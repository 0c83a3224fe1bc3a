"""FP8 routed experts as two grouped GEMMs in Triton: kernels/moe.py's tiles over FP8 e4m3 weights.

The weights are stacked `Fp8Weight`s (qweight [E, N, K], a scale per expert and output row). The
activations are quantized per row first (kernels/fp8.py `quantize_rows`), then kernels/moe.py's
`_gate_up_silu` (W8A8) computes gate and up = (xq @ qweight.T) * xs * scale, each rounded, and h =
SiLU(gate) * up; h is quantized per row and `_down_weighted` computes y = ((hq @ qweight.T) * hs *
scale, rounded) * the routing weight. Accumulation as kernels/fp8.py's; `fp8/experts.py w8a8_experts`
is the torch reference. Routing, static shapes and graph capture are kernels/moe.py's.
"""

from __future__ import annotations

import torch

from server.models.fp8.weight import Fp8Weight
from server.models.kernels.moe import Tile, run_experts


def fused_fp8_experts(x: torch.Tensor, gate_up: Fp8Weight, down: Fp8Weight, weights: torch.Tensor,
                      ids: torch.Tensor, tile: Tile | None = None) -> torch.Tensor:
    """x [T, hidden] in the model dtype, gate_up [E, 2I, hidden] and down [E, hidden, I] stacked FP8,
    weights [T, k] float32, ids [T, k] -> [T, hidden] in x's dtype (the `experts.ExpertsFn` contract);
    `tile`: this one instead of the warm-up's choice (kernels/moe.py `tiles`)."""
    return run_experts(x, gate_up, down, weights, ids, tile, w8a8=True)
