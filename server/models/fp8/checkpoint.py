"""The FP8 quantization a checkpoint declares in config.json's `quantization_config`, checked once.

Two layouts that users download: Hugging Face / vLLM `quant_method: fp8` (float8 `*.weight` tensors,
each with a float32 `*.weight_scale` or `*.weight_scale_inv`, per tensor, per output channel, or, for
`weight_block_size: [128, 128]`, per block: `from_block_checkpoint`), and compressed-tensors (llm-compressor)
`quant_method: compressed-tensors`. Which linears are FP8 is read from the tensors: modules a
checkpoint leaves in float (its ignore list) load as float. The KV cache scales some checkpoints
carry (`*.k_scale`, `*.v_scale`) belong to the KV cache, not to these weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

BLOCK = (128, 128)  # the one weight_block_size served


@dataclass(frozen=True)
class CheckpointQuant:
    method: str  # "fp8" or "compressed-tensors"
    static_activations: bool  # every FP8 linear has an input_scale (else activations are scaled per token)
    block: tuple[int, int] | None = None  # weight_block_size (rows, columns): one scale per block


def checkpoint_quant(raw: dict[str, Any], model_dir: Path) -> CheckpointQuant | None:
    """The FP8 scheme of a model's config.json (None: a float checkpoint); a ValueError that names the
    file and the key for a scheme pdserve does not serve."""
    qc = raw.get("quantization_config")
    if qc is None:
        return None
    where = f"model {model_dir}: config.json: quantization_config"
    if not isinstance(qc, dict):
        raise ValueError(f"{where}: must be a mapping, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method == "fp8":
        return _hf_fp8(qc, where)
    if method == "compressed-tensors":
        return _compressed_tensors(qc, where)
    raise ValueError(f"{where}.quant_method: {method!r} is not supported (supported: 'fp8', and "
                     "'compressed-tensors' with float8 weights)")


def _hf_fp8(qc: dict[str, Any], where: str) -> CheckpointQuant:
    if qc.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"{where}.fmt: {qc['fmt']!r}: only e4m3 FP8 weights are supported")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ValueError(f"{where}.activation_scheme: {scheme!r}: must be 'dynamic' or 'static'")
    block = qc.get("weight_block_size")
    if block is None:
        return CheckpointQuant("fp8", static_activations=scheme == "static")
    if not isinstance(block, list | tuple) or list(block) != list(BLOCK):
        raise ValueError(f"{where}.weight_block_size: {block!r}: only {list(BLOCK)} blocks are supported (as "
                         "DeepSeek-V3 and Qwen3-FP8 ship); serve the bf16 checkpoint with `quantization: fp8` instead")
    if scheme != "dynamic":
        raise ValueError(f"{where}.activation_scheme: {scheme!r}: block-wise FP8 weights are supported with "
                         "'dynamic' activations only")
    return CheckpointQuant("fp8", static_activations=False, block=BLOCK)


_FORMATS = (None, "float-quantized", "naive-quantized")


def _compressed_tensors(qc: dict[str, Any], where: str) -> CheckpointQuant:
    if qc.get("format") not in (*_FORMATS, "mixed-precision"):
        raise ValueError(f"{where}.format: {qc['format']!r}: only float8 weights are supported "
                         "('float-quantized' or 'naive-quantized')")
    if qc.get("quantization_status", "compressed") not in ("compressed", "frozen"):
        raise ValueError(f"{where}.quantization_status: {qc['quantization_status']!r}: the weights are not "
                         "quantized yet (want 'compressed' or 'frozen')")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError(f"{where}.config_groups: a mapping of at least one group is required")
    statics = [_group(group, f"{where}.config_groups.{name}") for name, group in groups.items()]
    return CheckpointQuant("compressed-tensors", static_activations=any(statics))


def _group(group: Any, where: str) -> bool:
    """Check one config group; True when its input activations have a static scale."""
    if not isinstance(group, dict):
        raise ValueError(f"{where}: must be a mapping")
    if group.get("format") not in _FORMATS:
        raise ValueError(f"{where}.format: {group['format']!r}: only float8 weights are supported")
    _float8(group.get("weights"), f"{where}.weights", ("tensor", "channel"))
    if group.get("weights", {}).get("dynamic"):
        raise ValueError(f"{where}.weights.dynamic: true: weights must have stored scales")
    if group.get("output_activations") is not None:
        raise ValueError(f"{where}.output_activations: quantized outputs are not supported")
    acts = group.get("input_activations")
    if acts is None:
        return False  # weight only: activations stay in the model dtype (the GPU scales them per token)
    _float8(acts, f"{where}.input_activations", ("token", "tensor"))
    if acts.get("dynamic") is False and acts.get("strategy") == "token":
        raise ValueError(f"{where}.input_activations: static per-token scales are not supported")
    return acts.get("dynamic") is False


def _float8(args: Any, where: str, strategies: tuple[str, ...]) -> None:
    if not isinstance(args, dict):
        raise ValueError(f"{where}: must be a mapping")
    if args.get("num_bits") != 8 or args.get("type") != "float":
        raise ValueError(f"{where}: num_bits {args.get('num_bits')!r}, type {args.get('type')!r}: only 8-bit "
                         "float (FP8 e4m3) is supported")
    if args.get("strategy") not in strategies:
        raise ValueError(f"{where}.strategy: {args.get('strategy')!r}: supported are {list(strategies)} "
                         "(block-wise and group-wise scales are not)")
    if args.get("symmetric", True) is not True:
        raise ValueError(f"{where}.symmetric: false: zero points are not supported")
