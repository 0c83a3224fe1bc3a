"""FP8 checkpoints made in the tests, as users download them, with their float32 reference.

`write_fp8(src, out, layout, per, static)` copies a float model directory and quantizes its seven linear
projections per layer to float8_e4m3fn: `layout` "hf-fp8" (config.json `quant_method: fp8`, scales
named `weight_scale`, or `weight_scale_inv` as DeepSeek and Qwen name them) or "compressed-tensors"
(llm-compressor's `config_groups`, scales shaped [N, 1] per channel); `per` "channel" or "tensor";
`static` adds an `input_scale` per linear (activation_scheme static); `kv_scales` a `k_scale` and a
`v_scale` per layer (the KV cache's, left to it). `per` "block" writes what DeepSeek-V3 and Qwen3-FP8
ship: `weight_block_size: [128, 128]`, one `weight_scale_inv` per 128 x 128 block (scale_name
"weight_scale_inv"), every linear in FP8 (a MoE layer's experts, and DeepSeek's latent-attention
projections too) but the routers, the embedding and the lm_head. `write_dequantized(fp8, out)`
writes the float32 model those FP8 weights stand for (W = q * scale, no quantization_config): the
reference that transformers and a float server run. `write_quantized_at_load(src, out)` is the same
reference for `quantization: fp8` on a float checkpoint.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from server.models.fp8.load import is_linear_weight
from server.models.fp8.weight import quantize_weight

FP8, FP8_MAX = torch.float8_e4m3fn, 448.0
STATIC_INPUT_SCALE = 4.0 / FP8_MAX  # activations up to 4 in magnitude keep their range
BLOCK = 128
MLA_LINEARS = ("q_a_proj.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight", "kv_b_proj.weight")


def write_fp8(src: Path, out: Path, layout: str = "hf-fp8", per: str = "channel", static: bool = False,
              scale_name: str = "weight_scale", kv_scales: bool = False) -> Path:
    tensors = load_file(str(src / "model.safetensors"))
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    saved: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if not is_linear_weight(name) and not (per == "block" and name.endswith(MLA_LINEARS)):
            saved[name] = tensor
            continue
        q, scale = _quantize(tensor.float(), per)
        base = name.removesuffix("weight")
        saved[name] = q
        saved[base + scale_name] = scale[:, None] if layout == "compressed-tensors" and per == "channel" else scale
        if static:
            saved[base + "input_scale"] = torch.tensor([STATIC_INPUT_SCALE])
        if kv_scales and name.endswith("self_attn.k_proj.weight"):  # the KV cache's, as vLLM's FP8 checkpoints hold
            attn = name.removesuffix("k_proj.weight")
            saved[attn + "k_scale"], saved[attn + "v_scale"] = torch.tensor(0.02), torch.tensor(0.03)
    save_file(saved, str(out / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = _config(layout, per, static)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def write_dequantized(fp8_dir: Path, out: Path) -> Path:
    """The float32 model of `fp8_dir`'s weights: each FP8 linear as q * scale, everything else as stored."""
    tensors = load_file(str(fp8_dir / "model.safetensors"))
    out.mkdir(parents=True, exist_ok=True)
    for f in fp8_dir.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    blocks = "weight_block_size" in json.loads((fp8_dir / "config.json").read_text())["quantization_config"]
    saved = {}
    for name, tensor in tensors.items():
        if name.endswith(("weight_scale", "weight_scale_inv", "input_scale", "k_scale", "v_scale")):
            continue
        if tensor.dtype == FP8:
            base = name.removesuffix("weight")
            scale = tensors.get(base + "weight_scale", tensors.get(base + "weight_scale_inv")).float()
            if blocks:  # one scale per 128 x 128 block
                n, k = tensor.shape
                scale = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:n, :k]
            tensor = tensor.float() * scale.reshape(tensor.shape[0] if scale.numel() > 1 else 1, -1)
        saved[name] = tensor.float().contiguous()
    save_file(saved, str(out / "model.safetensors"))
    config = json.loads((fp8_dir / "config.json").read_text())
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def write_quantized_at_load(src: Path, out: Path) -> Path:
    """The float32 model that `quantization: fp8` serves from the float checkpoint `src`: each linear
    weight replaced by its per-channel FP8 quantization, dequantized (`quantize_weight`, as the loader)."""
    tensors = load_file(str(src / "model.safetensors"))
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    saved = {n: quantize_weight(t).dequantize() if is_linear_weight(n) else t.float() for n, t in tensors.items()}
    save_file(saved, str(out / "model.safetensors"))
    return out


def _quantize(w: torch.Tensor, per: str) -> tuple[torch.Tensor, torch.Tensor]:
    if per == "block":
        return _quantize_blocks(w)
    amax = w.abs().amax(dim=1) if per == "channel" else w.abs().amax().reshape(1)
    scale = amax.clamp_min(1e-12) / FP8_MAX
    q = (w / scale.reshape(-1, 1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale.float()


def _quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q [N, K] float8, scale [ceil(N / 128), ceil(K / 128)]): each block's max to 448."""
    n, k = w.shape
    nb, kb = -(-n // BLOCK), -(-k // BLOCK)
    padded = torch.zeros(nb * BLOCK, kb * BLOCK)
    padded[:n, :k] = w
    amax = padded.view(nb, BLOCK, kb, BLOCK).abs().amax(dim=(1, 3))
    scale = amax.clamp_min(1e-12) / FP8_MAX
    full = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:n, :k]
    return (w / full).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale.float()


def _config(layout: str, per: str, static: bool) -> dict:
    if layout == "hf-fp8" and per == "block":
        return {"quant_method": "fp8", "activation_scheme": "static" if static else "dynamic",
                "weight_block_size": [BLOCK, BLOCK], "fmt": "e4m3"}
    if layout == "hf-fp8":
        return {"quant_method": "fp8", "activation_scheme": "static" if static else "dynamic",
                "ignored_layers": ["lm_head"]}
    acts = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": not static,
            "strategy": "tensor" if static else "token"}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "ignore": ["lm_head"], "kv_cache_scheme": None,
            "config_groups": {"group_0": {
                "targets": ["Linear"], "output_activations": None, "input_activations": acts,
                "weights": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": per,
                            "group_size": None, "block_structure": None}}}}
