"""DeepSeek-V2/V3's multi-head latent attention (MLA), as a model directory describes it, checked
once at load: shapes, softmax scale (with YaRN's mscale, as transformers computes it), rope layout,
and the refused options, each named by its key (docs/MODELS.md). The KV cache of an MLA model is the
latent (`MLASpec.latent_dim` values a token a layer), kvcache.KVFormat's "latent" layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from transformers import PretrainedConfig

MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")


@dataclass(frozen=True)
class MLASpec:
    q_lora_rank: int | None  # None: q from one projection (q_proj), else q_a_proj -> norm -> q_b_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # rotary pairs (x0, x1), (x2, x3), ... (V2 always; V3 unless rope_interleave false)
    softmax_scale: float  # qk_head_dim ** -0.5, times YaRN's mscale(factor, mscale_all_dim) squared

    @property
    def latent_dim(self) -> int:
        """Values a token caches per layer: kv_lora_rank + qk_rope_head_dim."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """transformers' `yarn_get_mscale`."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(rope: dict, qk_head_dim: int) -> float:
    """qk_head_dim ** -0.5, times mscale(factor, mscale_all_dim)**2 for a scaled rope with
    `mscale_all_dim` set (transformers' `yarn_apply_mscale`)."""
    scaling = qk_head_dim ** -0.5
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        mscale = yarn_mscale(rope["factor"], rope["mscale_all_dim"])
        scaling = scaling * mscale * mscale
    return scaling


def mla_spec(architecture: str, raw: dict, cfg: PretrainedConfig, rope: dict, model_dir: Path) -> MLASpec | None:
    """The MLA of a DeepSeek directory (None for other architectures; `rope`: its rope parameters);
    ValueError naming the config.json key of an option pdserve does not implement."""
    if architecture not in MLA_ARCHITECTURES:
        return None
    _refuse_unsupported(architecture, raw, model_dir)
    nope, rope_dim = int(cfg.qk_nope_head_dim), int(cfg.qk_rope_head_dim)
    interleave = architecture == "DeepseekV2ForCausalLM" or bool(getattr(cfg, "rope_interleave", True))
    return MLASpec(q_lora_rank=cfg.q_lora_rank or None, kv_lora_rank=int(cfg.kv_lora_rank), qk_nope_head_dim=nope,
                   qk_rope_head_dim=rope_dim, v_head_dim=int(cfg.v_head_dim), rope_interleave=interleave,
                   softmax_scale=softmax_scale(rope, nope + rope_dim))


def _refuse_unsupported(architecture: str, raw: dict, model_dir: Path) -> None:
    """The MLA side's refusals (the MoE router's are server/models/moe/config.py's)."""
    def refuse(key: str, why: str) -> None:
        raise ValueError(f"model {model_dir}: config.json: {key}: {raw.get(key)!r}: not supported for "
                         f"{architecture} ({why}; docs/MODELS.md)")

    if (raw.get("ep_size") or 1) > 1:
        refuse("ep_size", "the checkpoint's own expert parallelism; pdserve places experts itself")
    if raw.get("attention_bias"):
        refuse("attention_bias", "biases on the latent attention's projections")
    if raw.get("mlp_bias"):
        refuse("mlp_bias", "biases on the MLP projections")
    if raw.get("kv_lora_rank") in (None, 0):
        refuse("kv_lora_rank", "multi-head latent attention needs the compressed KV's rank")
