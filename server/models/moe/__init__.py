"""Mixture-of-experts feed-forward blocks (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2/V3, GLM-4.5).

`parse_moe` (config.py) reads a config.json's experts into a `MoESpec` (`ModelSpec.moe`; None for a
dense model); `build_moe` (block.py) loads one sparse layer's `MoEBlock` by HF tensor names; the
block is called like a dense MLP (`load_mlp`, server/models/mlp.py), `block(x, ops)` -> [T, hidden],
with tensor parallelism the rank's partial sum, all-reduced by the caller. `route` (router.py) is
the gate alone; `moe_blocks(model)` finds a model's blocks, whose `experts` the runner sets (the
Triton path, server/models/kernels/moe.py) and whose load `ExpertLoad` (load.py) reads for /metrics.
The forward has no host synchronisation on CUDA (experts.py says how), so it runs inside CUDA graphs.
"""

from server.models.moe.block import MoEBlock, build_moe, moe_blocks
from server.models.moe.config import MoESpec, parse_moe
from server.models.moe.router import route

__all__ = ["MoEBlock", "MoESpec", "build_moe", "moe_blocks", "parse_moe", "route"]
