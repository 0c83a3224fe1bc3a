"""transformers as the reference: greedy `generate` and full-prompt logits, cached per process.

Tests import it as `import hf_reference` (pytest puts tests/ on sys.path: tests/conftest.py is a
rootdir conftest of a folder without __init__.py, so the default "prepend" import mode adds it).

Two EOS rules, both returning exactly `max_new_tokens` tokens:
- `hf_greedy`: EOS is forbidden (`min_new_tokens = max_new_tokens`), like the engine's `min_tokens`.
- `hf_greedy_ignore_eos`: EOS may be picked and generation goes on past it, like vLLM's `ignore_eos`.
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
            device: str, forbid_eos: bool) -> tuple[int, ...]:
    model = hf_model(model_dir, dtype, device)
    ids = torch.tensor([prompt], device=device)
    # forbid_eos: transformers' MinNewTokens rule; else no EOS at all, so nothing stops or is masked
    eos = {"min_new_tokens": max_new_tokens} if forbid_eos else {"eos_token_id": None}
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, **eos)
    tokens = tuple(out[0, len(prompt):].tolist())
    assert len(tokens) == max_new_tokens, f"generate stopped early: {tokens}"
    return tokens


def hf_greedy(model_dir: str | Path, prompt_ids: Sequence[int], max_new_tokens: int, *,
              dtype: torch.dtype = torch.float32, device: str = "cpu") -> list[int]:
    """Exactly `max_new_tokens` greedy tokens of transformers `generate`, EOS forbidden (min_tokens)."""
    return list(_greedy(str(model_dir), tuple(prompt_ids), max_new_tokens, dtype, device, True))


def hf_greedy_ignore_eos(model_dir: str | Path, prompt_ids: Sequence[int], max_new_tokens: int, *,
                         dtype: torch.dtype = torch.float32, device: str = "cpu") -> list[int]:
    """Exactly `max_new_tokens` greedy tokens, EOS allowed and not stopping (vLLM's ignore_eos)."""
    return list(_greedy(str(model_dir), tuple(prompt_ids), max_new_tokens, dtype, device, False))


def hf_text_ignore_eos(model_dir: str | Path, prompt: str, max_new_tokens: int) -> str:
    """`hf_greedy_ignore_eos` of a text prompt, decoded as a server's text answer is (special tokens dropped)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = hf_greedy_ignore_eos(model_dir, tokenizer.encode(prompt), max_new_tokens)
    return tokenizer.decode(ids, skip_special_tokens=True)


def hf_logits(model_dir: str | Path, token_ids: Sequence[int], *, dtype: torch.dtype = torch.float32,
              device: str = "cpu") -> torch.Tensor:
    """float32 logits [len(token_ids), vocab] of one forward over `token_ids`."""
    model = hf_model(str(model_dir), dtype, device)
    with torch.inference_mode():
        return model(torch.tensor([list(token_ids)], device=device)).logits[0].float().cpu()
