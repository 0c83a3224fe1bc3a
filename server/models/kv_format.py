"""The KV cache a server builds for its model: the element type (`kv_cache_config.dtype`) and, for an
FP8 cache, each layer's k and v scales (a latent cache: one scale a layer, the k scale). The scales
come from, first found wins: `kv_cache_config.scales` (`pdserve calibrate-kv`, kvcache/kv_scales.py);
the checkpoint's (`CHECKPOINT_NAMES`; a per-head scale counts as its largest head); else 1.0 (as
vLLM, SGLang and TensorRT-LLM do): |K|, |V| up to 448 are kept, larger ones saturate there, and tiny
ones lose precision.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from kvcache import CacheLayout, KvCacheConfig, KVFormat
from kvcache.kv_scales import checked_scales, read_scales
from kvcache.layout import FP8, dtype_name
from server.models.model_spec import ModelSpec
from server.models.weights import read_header, safetensors_files

log = logging.getLogger(__name__)

# per layer i, the (K, V) scale names of the FP8 checkpoints users download, as each tool writes them
CHECKPOINT_NAMES = (
    ("model.layers.{i}.self_attn.k_scale", "model.layers.{i}.self_attn.v_scale"),  # compressed-tensors, vLLM
    ("model.layers.{i}.self_attn.k_proj.k_scale", "model.layers.{i}.self_attn.v_proj.v_scale"),  # NVIDIA ModelOpt
    ("model.layers.{i}.self_attn.k_proj.output_scale", "model.layers.{i}.self_attn.v_proj.output_scale"),  # AutoFP8
    ("model.layers.{i}.self_attn.kv_scale", "model.layers.{i}.self_attn.kv_scale"),  # older: one for both
)

Scales = tuple[tuple[float, ...], tuple[float, ...]]


def kv_dtype_name(config: KvCacheConfig, model_dtype: torch.dtype) -> str:
    """The element type of the KV blocks: FP8 e4m3 for `dtype: fp8`, else the model's dtype."""
    return dtype_name(FP8 if config.dtype == "fp8" else model_dtype)


def kv_cache_layout(config: KvCacheConfig, spec: ModelSpec, max_seq_len: int, model_dtype: torch.dtype,
                    device: torch.device | str) -> CacheLayout:
    """The layout of the KV cache `config` asks for, for the model `spec` describes (a tensor-parallel
    rank's local spec: its kv heads; the scales are per layer, the same on every rank)."""
    return spec.cache_layout(max_seq_len, kv_format(config, spec, model_dtype), device)


def kv_format(config: KvCacheConfig, spec: ModelSpec, model_dtype: torch.dtype) -> KVFormat:
    """The one KV format value of a server: the model's layout (K/V heads or MLA's latent) in the
    model's dtype, or FP8 with its per-layer scales (`kv_cache_config.dtype: fp8`)."""
    fmt = spec.kv_format(model_dtype)
    if config.dtype != "fp8":
        return fmt
    k, v = kv_scales(config, spec.model_dir, spec.num_layers)
    if fmt.latent:  # one row a token: its scale is the k scale (`pdserve calibrate-kv` writes k = v)
        return dataclasses.replace(fmt, dtype=FP8, k_scales=k)
    return dataclasses.replace(fmt, dtype=FP8, k_scales=k, v_scales=v)


def kv_scales(config: KvCacheConfig, model_dir: Path, num_layers: int) -> Scales:
    """The per-layer (k, v) scales of an FP8 cache: the scales file, the checkpoint's, or 1.0."""
    if config.scales is not None:
        scales = read_scales(config.scales, num_layers)
        log.info("FP8 KV cache: per-layer scales from %s", config.scales)
        return scales
    found = checkpoint_scales(model_dir, num_layers)
    if found is not None:
        log.info("FP8 KV cache: per-layer scales from the checkpoint's k/v scales")
        return found
    log.warning("FP8 KV cache: no scales (kv_cache_config.scales unset, none in the checkpoint): 1.0 for every "
                "layer; K or V beyond +-448 saturate (`pdserve calibrate-kv` measures them)")
    return (1.0,) * num_layers, (1.0,) * num_layers


def checkpoint_scales(model_dir: Path, num_layers: int) -> Scales | None:
    """The checkpoint's per-layer k/v scales under the first naming scheme of CHECKPOINT_NAMES that
    it uses, or None; ValueError when it names scales for some layers but not all."""
    where = {name: path for path in safetensors_files(model_dir) for name in read_header(path)}
    for k_name, v_name in CHECKPOINT_NAMES:
        names = [(k_name.format(i=i), v_name.format(i=i)) for i in range(num_layers)]
        present = [k in where and v in where for k, v in names]
        if not any(present):
            continue
        if not all(present):
            missing = [i for i, ok in enumerate(present) if not ok]
            raise ValueError(f"model {model_dir}: k/v scales named like {k_name!r} for some layers, "
                             f"none for layers {missing}")
        k = [_scalar(where[a], a) for a, _ in names]
        v = [_scalar(where[b], b) for _, b in names]
        return checked_scales(f"{model_dir}: {k_name}", k, num_layers), \
            checked_scales(f"{model_dir}: {v_name}", v, num_layers)
    return None


def _scalar(path: Path, name: str) -> float:
    """A scale tensor as one number (a per-head one: its largest, so no head saturates)."""
    with safe_open(str(path), framework="pt", device="cpu") as f:
        return float(f.get_tensor(name).float().max())
