"""What the runner needs to know about a model directory, parsed and checked once.

`load_spec(model_dir)` refuses, with a ValueError that names the problem, a directory without
config.json, weights or tokenizer, an unsupported architecture, activation or rope type. The parse
goes through transformers' `AutoConfig` (which normalizes each family's keys) after a raw check.
Window semantics are transformers': a query at position p attends keys k with p - window < k <= p.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, PretrainedConfig

from kvcache import CacheLayout, KVFormat
from server.models.fp8.checkpoint import CheckpointQuant, checkpoint_quant
from server.models.mla_spec import MLA_ARCHITECTURES, MLASpec, mla_spec
from server.models.moe.config import MoESpec, parse_moe
from server.models.weights import safetensors_files, tensor_signature

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "Glm4MoeForCausalLM",
                           *MLA_ARCHITECTURES)
PARTIAL_ROTARY_ARCHITECTURES = ("Glm4MoeForCausalLM",)  # transformers rotates only rotary_dim of their head dims
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # inv_freq independent of sequence length
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


@dataclass(frozen=True)
class ModelSpec:
    model_dir: Path
    architecture: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    layer_windows: tuple[int | None, ...]  # per layer sliding window in tokens; None = full attention
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3, GLM-4.5 (`use_qk_norm`): per-head RMSNorm of q and k before RoPE
    tie_word_embeddings: bool
    rope_type: str
    rotary_dim: int  # leading dims of each q/k head that RoPE rotates (rotate_half); the rest pass through
    eos_token_ids: tuple[int, ...]  # config.json and generation_config.json, deduplicated
    bos_token_id: int | None
    fingerprint: str  # sha256 hex of config.json + tensor names/shapes/dtypes
    hf_config: PretrainedConfig = field(repr=False, compare=False)  # for transformers' rope functions
    checkpoint_quant: CheckpointQuant | None = None  # the checkpoint's own FP8 scheme (config.json), if any
    quantization: str | None = None  # what its linears are served as: "fp8" (checkpoint or load time) or None
    moe: MoESpec | None = None  # the experts of a mixture-of-experts model (server/models/moe/)
    mla: MLASpec | None = None  # DeepSeek-V2/V3: multi-head latent attention (server/models/mla_spec.py)
    # tensor name prefixes the checkpoint holds but plain generation never reads (GLM-4.5's and
    # DeepSeek-V3's multi-token-prediction layers, `num_nextn_predict_layers` after the last decoder layer)
    unused_weights: tuple[str, ...] = ()

    def is_unused_weight(self, name: str) -> bool:
        return name.startswith(self.unused_weights)

    def kv_format(self, dtype: torch.dtype) -> KVFormat:
        """The KV format of this model's cache in `dtype`: K/V heads, or MLA's latent (one plane of
        kv_lora_rank + qk_rope_head_dim values a token, whatever the heads)."""
        if self.mla is not None:
            return KVFormat(dtype, 1, self.mla.latent_dim, layout="latent")
        return KVFormat(dtype, self.num_kv_heads, self.head_dim)

    def cache_layout(self, max_seq_len: int, dtype: torch.dtype | KVFormat,
                     device: torch.device | str) -> CacheLayout:
        """The KV cache this model needs, in `dtype` (the model's own format) or a given format:
        full attention window max_seq_len, sliding min(window, max_seq_len)."""
        windows = tuple(max_seq_len if w is None else min(w, max_seq_len) for w in self.layer_windows)
        fmt = dtype if isinstance(dtype, KVFormat) else self.kv_format(dtype)
        return CacheLayout(windows, fmt, device, max_seq_len)


def load_spec(model_dir: Path | str) -> ModelSpec:
    model_dir = Path(model_dir)
    raw = _read_raw_config(model_dir)
    architecture = _architecture(raw, model_dir)
    files = safetensors_files(model_dir)
    if not any((model_dir / name).is_file() for name in _TOKENIZER_FILES):
        raise ValueError(f"model {model_dir}: no tokenizer (none of {_TOKENIZER_FILES})")
    cfg = AutoConfig.from_pretrained(model_dir)
    _check_supported_math(cfg, model_dir)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    mla = mla_spec(architecture, raw, cfg, rope_parameters(cfg), model_dir)
    quant = checkpoint_quant(raw, model_dir)
    moe = parse_moe(raw, cfg, architecture, model_dir)
    family = architecture.removesuffix("ForCausalLM")
    attention_bias = bool(getattr(cfg, "attention_bias", False))
    return ModelSpec(
        model_dir=model_dir, architecture=architecture,
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_layers=cfg.num_hidden_layers, num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads or cfg.num_attention_heads,
        head_dim=head_dim,
        rms_norm_eps=float(cfg.rms_norm_eps), max_position_embeddings=cfg.max_position_embeddings,
        layer_windows=_layer_windows(cfg, family), qkv_bias=_qkv_bias(cfg, family, attention_bias),
        o_bias=family in ("Llama", "Qwen3", "Qwen3Moe") and attention_bias,
        mlp_bias=family == "Llama" and bool(getattr(cfg, "mlp_bias", False)),
        qk_norm=family in ("Qwen3", "Qwen3Moe") or (family == "Glm4Moe" and bool(cfg.use_qk_norm)),
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        rope_type=rope_parameters(cfg).get("rope_type", "default"),
        rotary_dim=_rotary_dim(cfg, architecture, head_dim, model_dir),
        eos_token_ids=_eos_ids(raw, model_dir), bos_token_id=raw.get("bos_token_id"),
        fingerprint=_fingerprint(raw, files), hf_config=cfg, checkpoint_quant=quant,
        quantization="fp8" if quant is not None else None, moe=moe, mla=mla,
        unused_weights=_prediction_layers(raw, cfg.num_hidden_layers),
    )


def _rotary_dim(cfg: PretrainedConfig, architecture: str, head_dim: int, model_dir: Path) -> int:
    """int(head_dim * partial_rotary_factor), as transformers computes it; a factor other than 1 only
    where the architecture's transformers code rotates part of the head (Llama's ignores it with the
    default rope and fails with a scaled one)."""
    factor = rope_parameters(cfg).get("partial_rotary_factor", 1.0)
    if factor == 1.0:
        return head_dim
    if architecture not in PARTIAL_ROTARY_ARCHITECTURES:
        raise ValueError(f"model {model_dir}: unsupported partial_rotary_factor {factor} for {architecture} "
                         f"(supported for {PARTIAL_ROTARY_ARCHITECTURES})")
    dim = int(head_dim * factor)
    if dim < 2 or dim % 2 or dim > head_dim:
        raise ValueError(f"model {model_dir}: config.json: partial_rotary_factor: {factor}: rotates {dim} of the "
                         f"{head_dim} head dims; an even number from 2 to head_dim is needed")
    return dim


def _prediction_layers(raw: dict, num_layers: int) -> tuple[str, ...]:
    """The name prefixes of the multi-token-prediction layers (`num_nextn_predict_layers`, numbered
    from num_hidden_layers on), which transformers' generate does not run either."""
    return tuple(f"model.layers.{num_layers + i}." for i in range(int(raw.get("num_nextn_predict_layers") or 0)))


def _qkv_bias(cfg: PretrainedConfig, family: str, attention_bias: bool) -> bool:
    if family == "Qwen2Moe":
        return bool(getattr(cfg, "qkv_bias", True))  # older configs lack the key: the biases were always there
    return family == "Qwen2" or (family not in ("Mistral", "Mixtral") and attention_bias)


def with_quantization(spec: ModelSpec, quantization: str | None) -> ModelSpec:
    """The spec a server serves with `quantization` ("fp8": a float checkpoint's linears quantized at
    load). Its fingerprint then differs from the float model's, so no prefix cache, disk tier or KV
    handoff ever mixes KV computed by the two. An FP8 checkpoint is FP8 either way."""
    if quantization is None or spec.quantization == quantization:
        return spec
    mixed = hashlib.sha256(f"{spec.fingerprint}|quantization={quantization}".encode()).hexdigest()
    return dataclasses.replace(spec, quantization=quantization, fingerprint=mixed)


def rope_parameters(cfg: PretrainedConfig) -> dict:
    """The rope dict: `rope_parameters` (transformers 5.x), else built from `rope_theta`/`rope_scaling`."""
    params = getattr(cfg, "rope_parameters", None)
    if params:
        return dict(params)
    params = dict(getattr(cfg, "rope_scaling", None) or {})
    params.setdefault("rope_type", params.pop("type", "default"))
    params.setdefault("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    if getattr(cfg, "partial_rotary_factor", None) is not None:  # transformers 4.x kept it at the top level
        params.setdefault("partial_rotary_factor", cfg.partial_rotary_factor)
    return params


def _read_raw_config(model_dir: Path) -> dict:
    if not model_dir.is_dir():
        raise ValueError(f"model {model_dir}: no such directory")
    path = model_dir / "config.json"
    if not path.is_file():
        raise ValueError(f"model {model_dir}: config.json is missing")
    return json.loads(path.read_text())


def _architecture(raw: dict, model_dir: Path) -> str:
    archs = raw.get("architectures") or []
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    raise ValueError(f"model {model_dir}: unsupported architecture {archs} "
                     f"(supported: {SUPPORTED_ARCHITECTURES})")


def _check_supported_math(cfg: PretrainedConfig, model_dir: Path) -> None:
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"model {model_dir}: unsupported hidden_act {act!r} (only 'silu')")
    rope = rope_parameters(cfg)
    if rope.get("rope_type", "default") not in STATIC_ROPE_TYPES:
        raise ValueError(f"model {model_dir}: unsupported rope_type {rope.get('rope_type')!r} "
                         f"(supported: {STATIC_ROPE_TYPES})")


def _layer_windows(cfg: PretrainedConfig, family: str) -> tuple[int | None, ...]:
    """Per layer window as transformers' modeling code applies it (None = full attention)."""
    n, window = cfg.num_hidden_layers, getattr(cfg, "sliding_window", None)
    if family in ("Mistral", "Mixtral"):  # these apply `sliding_window` to every layer and ignore layer_types
        return (window,) * n
    # full attention everywhere (Qwen MoE: sliding refused; GLM-4.5 and DeepSeek have no window)
    if family in ("Llama", "Qwen2Moe", "Qwen3Moe", "Glm4Moe") or family.startswith("Deepseek"):
        return (None,) * n
    types = getattr(cfg, "layer_types", None)
    if types is None:  # Qwen2/Qwen3 configs from versions without layer_types
        use = getattr(cfg, "use_sliding_window", False)
        first = getattr(cfg, "max_window_layers", n)
        types = ["sliding_attention" if use and i >= first else "full_attention" for i in range(n)]
    return tuple(window if t == "sliding_attention" else None for t in types)


def _eos_ids(raw: dict, model_dir: Path) -> tuple[int, ...]:
    ids: list[int] = []
    gen_path = model_dir / "generation_config.json"
    sources = [raw] + ([json.loads(gen_path.read_text())] if gen_path.is_file() else [])
    for source in sources:
        value = source.get("eos_token_id")
        for i in value if isinstance(value, list) else [value]:
            if i is not None and i not in ids:
                ids.append(int(i))
    return tuple(ids)


def _fingerprint(raw: dict, files: list[Path]) -> str:
    """sha256 of the config (minus the writer's version) and every tensor's name, dtype and shape."""
    config = {k: v for k, v in raw.items() if k != "transformers_version"}
    h = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    h.update(json.dumps(tensor_signature(files)).encode())
    return h.hexdigest()
