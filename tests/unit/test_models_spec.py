"""ModelSpec parsing per family, fingerprints and loader errors that name what is wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from server.models.builtin import build_tiny_model, materialize_builtin
from server.models.model_spec import load_spec

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("spec")
    variants = {
        "llama": ("llama", {}),
        "llama3": ("llama", {"rope_parameters": LLAMA3_ROPE, "tie_word_embeddings": True,
                             "attention_bias": True, "mlp_bias": True}),
        "mistral": ("mistral", {"sliding_window": 24, "eos_token_id": [2, 4]}),
        "qwen2": ("qwen2", {"use_sliding_window": True, "sliding_window": 24, "max_window_layers": 2}),
        "qwen2_nowin": ("qwen2", {"use_sliding_window": False, "sliding_window": 24}),
        "qwen3": ("qwen3", {"attention_bias": True}),
    }
    return {name: build_tiny_model(root / name, fam, **kw) for name, (fam, kw) in variants.items()}


def test_llama_default(models: dict[str, Path]) -> None:
    spec = load_spec(models["llama"])
    assert (spec.architecture, spec.vocab_size, spec.hidden_size, spec.intermediate_size) == (
        "LlamaForCausalLM", 512, 128, 256)
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (4, 4, 2, 32)
    assert spec.layer_windows == (None,) * 4
    assert (spec.qkv_bias, spec.o_bias, spec.mlp_bias, spec.qk_norm, spec.tie_word_embeddings) == (
        False, False, False, False, False)
    assert (spec.rope_type, spec.eos_token_ids, spec.bos_token_id, spec.max_position_embeddings) == (
        "default", (2,), 1, 4096)
    assert spec.hf_config.model_type == "llama"


def test_llama3_rope_tied_and_biases(models: dict[str, Path]) -> None:
    spec = load_spec(models["llama3"])
    assert spec.rope_type == "llama3"
    assert (spec.qkv_bias, spec.o_bias, spec.mlp_bias, spec.tie_word_embeddings) == (True, True, True, True)


def test_sliding_windows_per_family(models: dict[str, Path]) -> None:
    assert load_spec(models["mistral"]).layer_windows == (24,) * 4
    assert load_spec(models["mistral"]).eos_token_ids == (2, 4)
    qwen2 = load_spec(models["qwen2"])
    assert qwen2.layer_windows == (None, None, 24, 24)  # layers >= max_window_layers slide
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.qk_norm) == (True, False, False)
    assert load_spec(models["qwen2_nowin"]).layer_windows == (None,) * 4  # use_sliding_window=False
    qwen3 = load_spec(models["qwen3"])
    assert qwen3.layer_windows == (None,) * 4
    assert (qwen3.qk_norm, qwen3.qkv_bias, qwen3.o_bias) == (True, True, True)


def test_cache_layout_clips_windows(models: dict[str, Path]) -> None:
    layout = load_spec(models["qwen2"]).cache_layout(256, torch.float32, "cpu")
    assert layout.layer_windows == (256, 256, 24, 24)
    assert (layout.format.num_kv_heads, layout.format.head_dim, layout.max_seq_len) == (2, 32, 256)
    assert layout.format.dtype == torch.float32
    assert load_spec(models["mistral"]).cache_layout(16, torch.bfloat16, "cpu").layer_windows == (16,) * 4


def test_fingerprint_is_stable_and_tracks_config_and_tensors(models: dict[str, Path], tmp_path: Path) -> None:
    fp = load_spec(models["llama"]).fingerprint
    assert len(fp) == 64 and fp == load_spec(models["llama"]).fingerprint
    assert fp != load_spec(models["llama3"]).fingerprint
    copy = shutil.copytree(models["llama"], tmp_path / "copy")
    assert load_spec(copy).fingerprint == fp  # content, not path
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    assert load_spec(copy).fingerprint != fp


def _copy_without(src: Path, dst: Path, *names: str) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(*names))
    return dst


def test_missing_files_are_named(models: dict[str, Path], tmp_path: Path) -> None:
    src = models["llama"]
    with pytest.raises(ValueError, match="config.json is missing"):
        load_spec(_copy_without(src, tmp_path / "a", "config.json"))
    with pytest.raises(ValueError, match=r"no weights \(\*\.safetensors\)"):
        load_spec(_copy_without(src, tmp_path / "b", "*.safetensors"))
    with pytest.raises(ValueError, match="no tokenizer"):
        load_spec(_copy_without(src, tmp_path / "c", "tokenizer.json"))
    with pytest.raises(ValueError, match="no such directory"):
        load_spec(tmp_path / "nowhere")


def _edit_config(src: Path, dst: Path, **changes: object) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, **changes}))
    return dst


def test_unsupported_architecture_and_math_are_named(models: dict[str, Path], tmp_path: Path) -> None:
    src = models["llama"]
    with pytest.raises(ValueError, match=r"unsupported architecture \['GPT2LMHeadModel'\]"):
        load_spec(_edit_config(src, tmp_path / "a", architectures=["GPT2LMHeadModel"]))
    with pytest.raises(ValueError, match="unsupported hidden_act 'gelu'"):
        load_spec(_edit_config(src, tmp_path / "b", hidden_act="gelu"))
    dynamic = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(ValueError, match="unsupported rope_type 'dynamic'"):
        load_spec(_edit_config(src, tmp_path / "c", rope_parameters=dynamic))
    with pytest.raises(ValueError, match="unsupported partial_rotary_factor 0.5 for LlamaForCausalLM"):
        load_spec(_edit_config(src, tmp_path / "d", partial_rotary_factor=0.5))  # transformers' Llama ignores it


def test_glm4_moe_spec_and_its_partial_rotary_in_either_config_style(tmp_path: Path) -> None:
    """GLM-4.5: q/k/v biases (no o bias), q/k norms, RoPE on int(head_dim * partial_rotary_factor)
    dims, read from transformers 5's `rope_parameters` or a 4.x config's top-level keys; the
    multi-token-prediction layer's weights are named unused."""
    src = materialize_builtin("tiny-glm4-moe")
    spec = load_spec(src)
    assert (spec.architecture, spec.head_dim, spec.rotary_dim) == ("Glm4MoeForCausalLM", 32, 16)
    assert (spec.qkv_bias, spec.o_bias, spec.mlp_bias, spec.qk_norm) == (True, False, False, True)
    assert spec.layer_windows == (None,) * 4 and spec.moe.sparse_layers == (False, True, True, True)
    assert spec.unused_weights == ("model.layers.4.",)
    assert spec.is_unused_weight("model.layers.4.eh_proj.weight") and not spec.is_unused_weight("model.layers.3.x")
    assert load_spec(_edit_config(src, tmp_path / "no-norm", use_qk_norm=False)).qk_norm is False
    old = _old_style_config(src, tmp_path / "old", partial_rotary_factor=0.25)
    assert load_spec(old).rotary_dim == 8
    with pytest.raises(ValueError, match=r"partial_rotary_factor: 0.1: rotates 3 of the 32 head dims"):
        load_spec(_old_style_config(src, tmp_path / "odd", partial_rotary_factor=0.1))


def _old_style_config(src: Path, dst: Path, **changes: object) -> Path:
    """A copy whose config.json has transformers 4.x's top-level rope keys (as GLM-4.5's own has)."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config.update(rope_theta=rope["rope_theta"], **changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst
