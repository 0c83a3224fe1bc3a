"""Pieces of the runner's hot path, exactly: the K/V "units" views over the real pool, and RoPE applied
once to the fused qkv (q and k as transformers rotates them, v untouched; GLM-4.5's on half of each head)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kv_factories import make_manager
from transformers.models.glm4_moe import modeling_glm4_moe
from transformers.models.llama import modeling_llama

from kvcache import KVCacheManager
from server.models.attention import layer_units
from server.models.builtin import build_tiny_model
from server.models.model_spec import load_spec
from server.models.rope import Rotary, apply_rotary

TPB = 4


def _kv() -> KVCacheManager:
    return make_manager("cpu", tpb=TPB, primary_blocks=8, windows=(64, 64, 64), dim=8)


def test_units_views_address_k_and_v_of_every_slot_and_layer() -> None:
    kv = _kv()
    pool = kv.pool(64)  # [slots, layers, 2, tpb, kv_heads, head_dim]
    pool.copy_(torch.arange(pool.numel(), dtype=torch.float32).view_as(pool))
    for layer in range(3):
        units = layer_units(64, *kv.layer_cache(layer))
        assert units.units_per_slot == 6  # 3 layers x (K, V)
        assert units.blocks.shape == ((pool.shape[0] - 1) * 6 + 2, TPB, 2, 8)
        for slot in range(pool.shape[0]):
            for j in (0, 1):  # K, V
                u = slot * 6 + j
                assert torch.equal(units.blocks[u], pool[slot, layer, j])
                assert torch.equal(units.tokens[u * TPB + 3], pool[slot, layer, j, 3])
        units.tokens[(2 * 6 + 1) * TPB + 1] = -1.0  # slot 2, V, offset 1: writes reach the pool
        assert (pool[2, layer, 1, 1] == -1.0).all()
        assert (pool[2, layer, 0, 1] != -1.0).all()


def test_units_views_refuse_a_layout_where_v_does_not_follow_k() -> None:
    kv = _kv()
    k, v = kv.layer_cache(1)
    with pytest.raises(ValueError, match="V must follow K directly"):
        layer_units(64, k, kv.layer_cache(2)[1])  # V of another layer
    with pytest.raises(ValueError, match="V must follow K directly"):
        layer_units(64, k, v.clone())  # not in the pool


# family -> (transformers' modeling module, its RotaryEmbedding class, tiny-model overrides)
ROPE_FAMILIES = {
    "llama": (modeling_llama, "LlamaRotaryEmbedding", {}),
    "glm4_moe": (modeling_glm4_moe, "Glm4MoeRotaryEmbedding",  # rotates half of each head
                 {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8}),
}
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}


@pytest.mark.parametrize("family", list(ROPE_FAMILIES))
@pytest.mark.parametrize("rope", [{}, {"rope_parameters": YARN}])
def test_rope_equals_hf_on_q_and_k(tmp_path: Path, rope: dict, family: str) -> None:
    modeling, embedding, overrides = ROPE_FAMILIES[family]
    if family == "glm4_moe" and rope:
        rope = {"rope_parameters": {**YARN, "partial_rotary_factor": 0.5}}
    spec = load_spec(build_tiny_model(tmp_path / "m", family, **overrides, **rope))
    assert spec.rotary_dim == (spec.head_dim // 2 if family == "glm4_moe" else spec.head_dim)
    rotary = Rotary(spec, torch.device("cpu"))
    heads, kv_heads, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    positions = torch.tensor([0, 1, 5, 63, 200, 1000])
    qkv = torch.randn(len(positions), heads + 2 * kv_heads, d)
    cos, sin = rotary.cos_sin(positions, torch.float32)  # [T, rotary_dim] each
    # transformers' own rotary embedding and apply_rotary_pos_emb on the same positions
    hf_cos, hf_sin = getattr(modeling, embedding)(spec.hf_config)(qkv, positions[None])  # [1, T, rotary_dim]
    q, k, _ = qkv.split([heads, kv_heads, kv_heads], 1)
    hf_q, hf_k = modeling.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], hf_cos, hf_sin)
    assert torch.equal(apply_rotary(q, cos, sin), hf_q[0].transpose(0, 1))
    assert torch.equal(apply_rotary(k, cos, sin), hf_k[0].transpose(0, 1))


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2-moe", "tiny-deepseek-v3"])
def test_building_the_model_takes_every_loaded_tensor_out_of_the_dict(name: str) -> None:
    """The unfused parts (q, k, v; gate, up; each expert) must not outlive their fused tensors: on a
    GPU the KV pool is sized before the model is built, and an 8B model's parts held to the end
    (~9 GB beside the pool) ran an 80 GB H100 out of memory at load."""
    from kvcache.config import KvCacheConfig
    from server.models.builtin import materialize_builtin
    from server.models.runner import ModelRunner, load_weights

    model_dir = materialize_builtin(name)
    spec = load_spec(model_dir)
    weights = load_weights(spec, torch.float32, torch.device("cpu"))
    assert len(weights) > 10
    kv = KVCacheManager(KvCacheConfig(max_tokens=256, tokens_per_block=16),
                        spec.cache_layout(128, torch.float32, "cpu"))
    runner = ModelRunner(model_dir, kv, dtype=torch.float32, device=torch.device("cpu"), max_num_tokens=64,
                         max_batch_size=2, tensors=weights, kernels="torch")
    assert weights == {} and runner.model is not None


def test_a_weight_the_model_does_not_use_is_still_refused(tmp_path: Path) -> None:
    from server.models.builtin import materialize_builtin
    from server.models.llama import _WeightTable

    table = _WeightTable(load_spec(materialize_builtin("tiny-llama")), {"a": torch.zeros(1), "b": torch.zeros(1)})
    assert table.take("a") is not None and not table.has("a")
    with pytest.raises(ValueError, match=r"unexpected weights \['b'\]"):
        table.check_all_used()
