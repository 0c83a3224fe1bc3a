"""Loading a model's weights with FP8 linears: a checkpoint's own FP8 tensors, or a float checkpoint
quantized tensor by tensor as it is read, on the device (`quantization: fp8`; peak memory: the FP8
model plus one float tensor). Scales and a float32 router (as transformers keeps it) load as float32.

What stays in the model dtype, and why: the embedding (one row read a token: no bandwidth saved),
the lm_head (its rounding would move the output most, for ~7% of an 8B model's bytes), the norms, a
MoE router (it picks the experts) and DeepSeek's latent projections other than q_proj and o_proj. A
checkpoint that stores one of those in FP8 has it dequantized here.
"""

from __future__ import annotations

from typing import Any

import torch

from server.models.fp8.weight import FP8, Fp8Weight, from_block_checkpoint, from_checkpoint, quantize_weight
from server.models.weights import Slicer, load_tensors, safetensors_files

QUANTIZATIONS = ("fp8",)  # `quantization:` values; None (the default) serves the checkpoint as stored
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
EXPERT_LINEARS = ("w1", "w2", "w3")  # Mixtral's experts' gate, down, up
STACKED_EXPERTS = (".experts.gate_up_proj", ".experts.down_proj")  # transformers 5: [E, N, K]
WEIGHT_SCALES = (".weight_scale", ".weight_scale_inv")
INPUT_SCALE = ".input_scale"
# the attention's and KV cache's scales (`*.k_scale`, `*.v_scale`; `q_scale`; older checkpoints' k/v
# `output_scale`): the KV cache reads them from the checkpoint itself; they are none of these weights'
KV_SCALES = (".k_scale", ".v_scale", ".q_scale", "_proj.output_scale")
SCALES = (*WEIGHT_SCALES, INPUT_SCALE, *KV_SCALES)
# a float32 router's tensors (DeepSeek-V2/V3, GLM-4.5), which transformers keeps in float32 whatever
# the model dtype (`_keep_in_fp32_modules_strict`)
FLOAT32_ROUTER = (".mlp.gate.weight", ".mlp.gate.e_score_correction_bias")


def is_linear_weight(name: str) -> bool:
    """A layer's q/k/v/o/gate/up/down projection weight (a MoE layer's experts too), by HF name."""
    if not name.startswith("model.layers."):
        return False
    if name.endswith(STACKED_EXPERTS):
        return True
    parts = name.split(".")
    if parts[-1] != "weight":
        return False
    return parts[-2] in LINEARS or (parts[-2] in EXPERT_LINEARS and parts[-4] == "experts")


def load_checkpoint(spec: Any, *, dtype: torch.dtype, device: torch.device, quantization: str | None = None,
                    slicer: Slicer | None = None) -> dict[str, Any]:
    """Every tensor of the model (a `model_spec.ModelSpec`) but those generation never reads
    (`ModelSpec.unused_weights`), each linear an `Fp8Weight` where the checkpoint is FP8 or
    `quantization` is "fp8", everything else a tensor in `dtype` on `device`."""
    if quantization not in (None, *QUANTIZATIONS):
        raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)} or null, got {quantization!r}")
    quantize = quantization == "fp8" and spec.checkpoint_quant is None
    moe = getattr(spec, "moe", None)
    float32 = FLOAT32_ROUTER if moe is not None and moe.router_float32 else ()
    tensors = load_tensors(safetensors_files(spec.model_dir), device=device, slicer=slicer,
                           convert=_converter(quantize, dtype, device, float32), skip=spec.is_unused_weight)
    return assemble(tensors, spec, dtype)


def _converter(quantize: bool, dtype: torch.dtype, device: torch.device, float32: tuple[str, ...]):
    """`float32`: name suffixes of the tensors kept in float32 (a float32 router's)."""
    def convert(name: str, tensor: torch.Tensor) -> torch.Tensor | Fp8Weight:
        tensor = tensor.to(device)
        if tensor.dtype == FP8:
            return tensor
        if tensor.dtype.itemsize == 1 and tensor.dtype.is_floating_point:
            raise ValueError(f"weight {name!r}: {tensor.dtype} is not supported (FP8 weights are float8_e4m3fn)")
        if name.endswith(SCALES) or name.endswith(float32):
            return tensor.float()
        if quantize and is_linear_weight(name):
            return quantize_weight(tensor)  # from the stored precision, not after a cast to `dtype`
        return tensor.to(dtype)

    return convert


def assemble(tensors: dict[str, Any], spec: Any, dtype: torch.dtype) -> dict[str, Any]:
    """Pair each float8 weight with its scale (and static input scale) into an `Fp8Weight`; a float8
    tensor that is no linear weight is dequantized to `dtype`; the KV cache's scales are left out."""
    out: dict[str, Any] = {}
    used: set[str] = set()
    for name, tensor in tensors.items():
        if isinstance(tensor, torch.Tensor) and tensor.dtype == FP8:
            weight = _fp8_weight(name, tensor, tensors, spec)
            used.update(name.removesuffix("weight") + s.lstrip(".") for s in (*WEIGHT_SCALES, INPUT_SCALE))
            out[name] = weight if is_linear_weight(name) else weight.dequantize(dtype)
    for name, tensor in tensors.items():
        if name not in out and name not in used and not name.endswith(KV_SCALES):
            out[name] = tensor
    return out


def _fp8_weight(name: str, qweight: torch.Tensor, tensors: dict[str, Any], spec: Any) -> Fp8Weight:
    base = name.removesuffix("weight")
    scales = [tensors[base + s.lstrip(".")] for s in WEIGHT_SCALES if base + s.lstrip(".") in tensors]
    where = f"model {spec.model_dir}: FP8 weight {name!r}"
    if len(scales) != 1:
        raise ValueError(f"{where}: wants exactly one of {[base + s.lstrip('.') for s in WEIGHT_SCALES]}, "
                         f"found {len(scales)}")
    quant = spec.checkpoint_quant
    static = quant is not None and quant.static_activations
    input_scale = tensors.get(base + "input_scale") if static else None
    if static and input_scale is None:
        raise ValueError(f"{where}: the checkpoint's activations are static (config.json quantization_config) "
                         f"but {base + 'input_scale'!r} is missing")
    try:
        if quant is not None and quant.block is not None:
            return from_block_checkpoint(qweight, scales[0], quant.block, name)
        return from_checkpoint(qweight, scales[0], input_scale, name)
    except ValueError as exc:
        raise ValueError(f"model {spec.model_dir}: {exc}") from None
