"""Mixture-of-experts feed-forward blocks (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2/V3, GLM-4.5),
called like a dense MLP; the forward has no host synchronisation on CUDA, so it runs in CUDA graphs."""

from server.models.moe.block import MoEBlock, build_moe, moe_blocks
from server.models.moe.config import MoESpec, parse_moe
from server.models.moe.router import route

__all__ = ["MoEBlock", "MoESpec", "build_moe", "moe_blocks", "parse_moe", "route"]
