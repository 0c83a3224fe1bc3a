"""The built-in models by name, and the head counts of any model, without torch or transformers.

The config loader checks `tensor_parallel_size` against the model's heads (`attention_heads`), and
the router reads deployments too, so this module imports neither (builtin.py builds the models).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BUILTIN_PREFIX = "builtin:"
PACKAGED_ROOT = Path(__file__).resolve().parent / "data"
# trained models shipped as package data: name -> folder under PACKAGED_ROOT, and what rebuilds it
PACKAGED_MODELS: dict[str, str] = {"tiny-story": "scripts/train_tiny_story.py"}

# shared shape of every tiny model: ~0.7 M parameters, head_dim 32 (vLLM CPU needs >= 32)
TINY_SHAPE: dict[str, Any] = dict(
    hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, max_position_embeddings=4096, rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


@dataclass(frozen=True)
class BuiltinModel:
    family: str
    version: int  # bump when the recipe changes: a new folder is built, old caches stay valid
    overrides: dict[str, Any] = field(default_factory=dict)


# DeepSeek's multi-head latent attention at tiny size (4 heads, a latent of 32 + 16 values a token);
# layer 0 dense, the others 8 routed experts (2 a token) and a shared one
TINY_MLA: dict[str, Any] = dict(
    num_key_value_heads=4, head_dim=16, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=24,
    moe_intermediate_size=64, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
    routed_scaling_factor=2.5, first_k_dense_replace=1,
)

BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "tiny-llama": BuiltinModel("llama", 2),
    "tiny-qwen3-swa": BuiltinModel(
        "qwen3", 2,
        dict(use_sliding_window=True, sliding_window=64, max_window_layers=0,
             layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"]),
    ),
    # mixture-of-experts: 8 experts, 2 per token, so routing decides the output
    "tiny-mixtral": BuiltinModel("mixtral", 1, dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=128)),
    "tiny-qwen2-moe": BuiltinModel(  # a sigmoid-gated shared expert; top-k weights not renormalised
        "qwen2_moe", 1,
        dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=128,
             norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[]),
    ),
    "tiny-qwen3-moe": BuiltinModel(  # layer 1 dense (mlp_only_layers), the others sparse
        "qwen3_moe", 1,
        dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
             decoder_sparse_step=1, mlp_only_layers=[1]),
    ),
    # softmax gate (greedy top-k), q from one projection, default rope
    "tiny-deepseek-v2": BuiltinModel("deepseek_v2", 3, dict(TINY_MLA, q_lora_rank=None, topk_method="greedy")),
    # sigmoid gate over groups, q through its own low-rank projection, YaRN with both mscales
    "tiny-deepseek-v3": BuiltinModel("deepseek_v3", 3, dict(
        TINY_MLA, q_lora_rank=48, n_group=2, topk_group=1,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=1024,
                             beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=0.8))),
    # GLM-4.5's shape: GQA with q/k/v biases and q/k norms, RoPE on half of each head; DeepSeek-V3's
    # gate (sigmoid over 2 groups, a correction bias); layer 0 dense; one multi-token-prediction layer
    # in the checkpoint (builtin.py writes it), which generation does not use
    "tiny-glm4-moe": BuiltinModel("glm4_moe", 1, dict(
        partial_rotary_factor=0.5, use_qk_norm=True, attention_bias=True, moe_intermediate_size=64,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1, num_nextn_predict_layers=1)),
}


def attention_heads(model: str) -> tuple[int, int] | None:
    """(attention heads, kv heads) of `model` (a built-in name or a model directory); None when its
    config.json cannot be read here (the server that loads it checks again)."""
    name = model.removeprefix(BUILTIN_PREFIX)
    if model.startswith(BUILTIN_PREFIX) and name in BUILTIN_MODELS:
        config = {**TINY_SHAPE, **BUILTIN_MODELS[name].overrides}
    else:
        folder = PACKAGED_ROOT / name if model.startswith(BUILTIN_PREFIX) else Path(model).expanduser()
        try:
            config = json.loads((folder / "config.json").read_text())
        except (OSError, ValueError):
            return None
    heads = config.get("num_attention_heads")
    if not isinstance(heads, int):
        return None
    kv = config.get("num_key_value_heads") or heads
    return heads, kv
