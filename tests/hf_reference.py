"""transformers as the reference: greedy `generate` and full-prompt logits, cached per process.

Tests import it as `import hf_reference` (pytest puts tests/ on sys.path: tests/conftest.py is a
rootdir conftest of a folder without __init__.py, so the default "prepend" import mode adds it).

`hf_greedy` ignores EOS the way the engine's `min_tokens`/`ignore_eos` does: `min_new_tokens =
max_new_tokens`, so exactly `max_new_tokens` tokens come back.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel


@functools.lru_cache(maxsize=8)
def hf_model(model_dir: str | Path, dtype: torch.dtype = torch.float32,
             device: str = "cpu") -> PreTrainedModel:
    """The transformers model of `model_dir` (eval mode), loaded once per process."""
    model = AutoModelForCausalLM.from_pretrained(Path(model_dir), dtype=dtype)
    return model.to(device).eval()


@functools.lru_cache(maxsize=512)
def _greedy(model_dir: str, prompt: tuple[int, ...], max_new_tokens: int, dtype: torch.dtype,
            device: str) -> tuple[int, ...]:
    model = hf_model(model_dir, dtype, device)
    ids = torch.tensor([prompt], device=device)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False)
    return tuple(out[0, len(prompt):].tolist())


def hf_greedy(model_dir: str | Path, prompt_ids: Sequence[int], max_new_tokens: int, *,
              dtype: torch.dtype = torch.float32, device: str = "cpu") -> list[int]:
    """Exactly `max_new_tokens` greedy tokens of transformers `generate` after `prompt_ids`."""
    return list(_greedy(str(model_dir), tuple(prompt_ids), max_new_tokens, dtype, device))


def hf_logits(model_dir: str | Path, token_ids: Sequence[int], *, dtype: torch.dtype = torch.float32,
              device: str = "cpu") -> torch.Tensor:
    """float32 logits [len(token_ids), vocab] of one forward over `token_ids`."""
    model = hf_model(str(model_dir), dtype, device)
    with torch.inference_mode():
        return model(torch.tensor([list(token_ids)], device=device)).logits[0].float().cpu()


@functools.lru_cache(maxsize=512)
def _greedy_no_eos(model_dir: str, prompt: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
    from transformers import GenerationConfig

    model = hf_model(model_dir, torch.float32, "cpu")
    ids = torch.tensor([prompt])
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                              pad_token_id=model.generation_config.pad_token_id)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return tuple(out[0, len(prompt):].tolist())


def hf_greedy_ignore_eos(model_dir: str | Path, prompt_ids: Sequence[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens with EOS neither masked nor stopping (the engine's `ignore_eos`), float32 CPU."""
    return list(_greedy_no_eos(str(model_dir), tuple(prompt_ids), max_new_tokens))
