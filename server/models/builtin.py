"""Built-in models: a trained default that ships in the package, and deterministic random tiny models.

`builtin:tiny-story` (the default in configs/) is a ~2 M parameter Llama trained on English text
(scripts/train_tiny_story.py), shipped as package data. The random tiny models (catalog.py) serve
the exactness tests: `resolve_model` builds one once into `$PDSERVE_CACHE_DIR/models/<name>-v<N>`;
processes starting at once each build into a private folder and rename it into place, the first
rename winning, so a folder that exists is complete. Random init makes tiny models repeat one token,
so weights are drawn from our own seeded generator with gains large enough that greedy output varies
and depends on the whole context.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from server.models.catalog import BUILTIN_MODELS, BUILTIN_PREFIX, PACKAGED_MODELS, PACKAGED_ROOT, TINY_SHAPE
from server.models.tiny_tokenizer import train_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedModel

SEED = 1234

_CLASS_PREFIXES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3",
                   "mixtral": "Mixtral", "qwen2_moe": "Qwen2Moe", "qwen3_moe": "Qwen3Moe",
                   "deepseek_v2": "DeepseekV2", "deepseek_v3": "DeepseekV3", "glm4_moe": "Glm4Moe"}
FAMILIES = tuple(_CLASS_PREFIXES)
# families whose published checkpoints hold their `num_nextn_predict_layers` multi-token-prediction
# layers, which transformers' model does not build: a tiny model gets random ones (`_add_prediction_layers`)
_PREDICTION_LAYERS = ("glm4_moe",)


def cache_root() -> Path:
    """Where built-in models live: `$PDSERVE_CACHE_DIR/models` or `~/.cache/pdserve/models`."""
    base = os.environ.get("PDSERVE_CACHE_DIR")
    return (Path(base) if base else Path.home() / ".cache" / "pdserve") / "models"


def resolve_model(name_or_path: str, *, root: Path | None = None) -> Path:
    """A model directory for `name_or_path`: "builtin:<name>" is materialized, a path must exist."""
    if name_or_path.startswith(BUILTIN_PREFIX):
        return materialize_builtin(name_or_path.removeprefix(BUILTIN_PREFIX), root=root)
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        raise ValueError(f"model {name_or_path!r}: no such directory (builtin models: {builtin_names()})")
    return path


def builtin_names() -> list[str]:
    return [BUILTIN_PREFIX + name for name in sorted({*BUILTIN_MODELS, *PACKAGED_MODELS})]


def packaged_model(name: str) -> Path:
    """The folder of the shipped model `name`; a ValueError if the package lacks its files."""
    path = PACKAGED_ROOT / name
    missing = [f for f in ("config.json", "model.safetensors", "tokenizer.json") if not (path / f).is_file()]
    if missing:
        raise ValueError(f"builtin model {name!r}: {path} lacks {', '.join(missing)} "
                         f"(rebuild it with `python {PACKAGED_MODELS[name]}`)")
    return path


def materialize_builtin(name: str, *, root: Path | None = None) -> Path:
    """The folder of the built-in model `name`: the shipped one, or built once (atomically) into the cache."""
    if name in PACKAGED_MODELS:
        return packaged_model(name)
    recipe = BUILTIN_MODELS.get(name)
    if recipe is None:
        raise ValueError(f"unknown builtin model {name!r}; known: {builtin_names()}")
    target = (root or cache_root()) / f"{name}-v{recipe.version}"
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        build_tiny_model(tmp, recipe.family, **recipe.overrides)
        tmp.chmod(0o755)  # mkdtemp makes it private
        os.rename(tmp, target)  # atomic; fails if another process renamed its copy first
    except OSError:
        if not target.is_dir():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def build_tiny_model(out_dir: Path, family: str, **config_overrides: Any) -> Path:
    """Write a deterministic tiny `family` model (one of FAMILIES: weights, config, tokenizer) into
    `out_dir`; `config_overrides` go to the transformers config (e.g. `sliding_window`)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; known: {sorted(FAMILIES)}")
    # transformers' modeling code is imported only here, so a server that loads a built model never pays for it
    import transformers

    prefix = _CLASS_PREFIXES[family]
    config_cls, model_cls = getattr(transformers, f"{prefix}Config"), getattr(transformers, f"{prefix}ForCausalLM")
    tokenizer = train_tokenizer()
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)
    config = config_cls(**{**TINY_SHAPE, "vocab_size": len(tokenizer), **ids, **config_overrides})
    model = model_cls(config).eval()
    _init_weights(model)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    if family in _PREDICTION_LAYERS:
        _add_prediction_layers(out_dir, config.num_hidden_layers, getattr(config, "num_nextn_predict_layers", 0))
    tokenizer.save_pretrained(out_dir)
    return out_dir


def _add_prediction_layers(out_dir: Path, num_layers: int, count: int) -> None:
    """Multi-token-prediction layers numbered from `num_layers` on, named as GLM-4.5's checkpoints
    name them: a decoder layer (a copy of the last one's tensors, noise added) and its projections
    `eh_proj`, `enorm`, `hnorm`, `shared_head.norm`."""
    from safetensors.torch import load_file, save_file

    path = out_dir / "model.safetensors"
    tensors = load_file(path)
    last = f"model.layers.{num_layers - 1}."
    gen = torch.Generator().manual_seed(SEED + 1)
    hidden = tensors["model.embed_tokens.weight"].shape[1]
    for i in range(num_layers, num_layers + count):
        layer = f"model.layers.{i}."
        for name in [n for n in tensors if n.startswith(last)]:
            tensors[layer + name.removeprefix(last)] = tensors[name] + 0.1 * torch.randn(tensors[name].shape,
                                                                                        generator=gen)
        extra = {"eh_proj.weight": (hidden, 2 * hidden), "enorm.weight": (hidden,), "hnorm.weight": (hidden,),
                 "shared_head.norm.weight": (hidden,)}
        for name, shape in extra.items():
            tensors[layer + name] = _draw(name, shape, gen)
    save_file(tensors, path, metadata={"format": "pt"})


@torch.no_grad()
def _init_weights(model: PreTrainedModel) -> None:
    """Fill every parameter from one seeded generator, in name order (independent of HF's init).

    Linear weights N(0, 1.5 / sqrt(fan_in)) so each layer changes the residual stream substantially
    and attention mixes the context; norms and biases get noise, so a loader that drops or swaps them
    is caught; so does DeepSeek-V3's expert-choice bias (zero in transformers' init).
    """
    gen = torch.Generator().manual_seed(SEED)
    for name, param in sorted(model.named_parameters()):
        param.copy_(_draw(name, tuple(param.shape), gen).to(param.dtype))
    for name, buffer in sorted(model.named_buffers()):
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(0.2 * torch.randn(tuple(buffer.shape), generator=gen))
    if model.config.tie_word_embeddings:
        model.tie_weights()


def _draw(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    noise = torch.randn(shape, generator=gen)
    if "norm" in name:
        return 1.0 + 0.2 * noise
    if name.endswith("bias"):
        return 0.2 * noise
    if "embed_tokens" in name:
        return noise
    return noise * (1.5 / math.sqrt(shape[-1]))
