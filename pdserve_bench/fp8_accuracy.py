"""What FP8 weights cost in accuracy, measured on the CPU through pdserve's own runner.

Models: `builtin:tiny-story` (trained on Python's docs, scripts/train_tiny_story.py) and a small Qwen3
trained for about a minute (pdserve_bench/trained_qwen3.py). Text: docstrings of standard library
modules neither was trained on (`tiny_story_corpus.held_out_documents`).

Each model runs three ways (`VARIANTS`), float32 on the CPU, kernels "torch":
- "float32": the checkpoint as stored, the reference;
- "fp8": `quantization: fp8` as a CPU server serves it (linears FP8 per output channel, dequantized to
  float32 for the multiply: the weight rounding alone);
- "fp8_w8a8": the same weights with activations also rounded to FP8 per token, as the GPU's FP8
  GEMMs compute (`W8A8TorchOps`).
Figures: perplexity over the held-out text in windows of WINDOW tokens (each window starts fresh),
and over SEEN_TOKENS tokens of the training text (tiny-story memorised its corpus: its held-out
perplexity is high, its seen one low, and FP8 should move neither);
top-1 agreement with float32 at every position of that text; and greedy agreement: GREEDY_TOKENS
greedy tokens after each of PROMPTS prompts, how many prompts give exactly float32's tokens and how
many tokens agree before the first difference, on average.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoTokenizer

from kvcache import KvCacheConfig, KVCacheManager
from pdserve_bench import tiny_story_corpus as corpus
from server.models.fp8.weight import Fp8Weight, w8a8_linear
from server.models.model_spec import load_spec
from server.models.ops import TorchOps, Weight
from server.models.runner import ModelRunner, SeqChunk

VARIANTS = ("float32", "fp8", "fp8_w8a8")
WINDOW = 256
TPB = 16
PROMPTS, PROMPT_TOKENS, GREEDY_TOKENS = 8, 24, 64
SEEN_TOKENS = 4096


class W8A8TorchOps(TorchOps):
    """The GPU's FP8 numerics in plain torch: an FP8 linear's activations rounded per token
    (`w8a8_linear`), so a CPU measures what the GPU's FP8 path costs."""

    def linear(self, x: torch.Tensor, weight: Weight, bias: torch.Tensor | None) -> torch.Tensor:
        if isinstance(weight, Fp8Weight):
            return w8a8_linear(x, weight, bias)
        return super().linear(x, weight, bias)


def make_runner(model_dir: Path, variant: str) -> ModelRunner:
    spec = load_spec(model_dir)
    max_len = WINDOW + GREEDY_TOKENS + PROMPT_TOKENS
    kv = KVCacheManager(KvCacheConfig(tokens_per_block=TPB, max_tokens=2 * max_len),
                        spec.cache_layout(max_len, torch.float32, "cpu"))
    runner = ModelRunner(model_dir, kv, dtype=torch.float32, device=torch.device("cpu"), max_num_tokens=max_len,
                         max_batch_size=1, kernels="torch", quantization=None if variant == "float32" else "fp8")
    if variant == "fp8_w8a8":
        runner.model.ops = W8A8TorchOps(spec.rms_norm_eps)
    return runner


def held_out_ids(model_dir: Path) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = "\n\n".join(corpus.plain_text(d) for d in corpus.held_out_documents())
    return tokenizer.encode(text, add_special_tokens=False)


def seen_ids(model_dir: Path) -> list[int]:
    """The first SEEN_TOKENS tokens of the training documents' running text."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids: list[int] = []
    for doc in corpus.documents():
        ids += tokenizer.encode(corpus.plain_text(doc), add_special_tokens=False)
        if len(ids) >= SEEN_TOKENS:
            return ids[:SEEN_TOKENS]
    return ids


def prompts(model_dir: Path, count: int = PROMPTS) -> list[list[int]]:
    """The first PROMPT_TOKENS tokens of the first paragraph of `count` held-out documents, spread over them."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    docs = [d for d in corpus.held_out_documents() if len(d.paragraphs[0]) > 4 * PROMPT_TOKENS]
    step = max(1, len(docs) // count)
    return [tokenizer.encode(d.paragraphs[0], add_special_tokens=False)[:PROMPT_TOKENS] for d in docs[::step][:count]]


def window_logits(runner: ModelRunner, ids: list[int]) -> list[tuple[torch.Tensor, list[int]]]:
    """(logits [n, vocab], the n next tokens) per window of WINDOW inputs over `ids`."""
    out = []
    for start in range(0, len(ids) - 1, WINDOW):
        chunk = ids[start:start + WINDOW + 1]
        inputs = chunk[:-1]
        logits = runner.execute([SeqChunk(inputs, 0, _tables(runner, len(inputs)), True, num_logits=len(inputs))])
        out.append((logits, chunk[1:]))
    return out


def perplexity(windows: list[tuple[torch.Tensor, list[int]]]) -> float:
    nll = sum(F.cross_entropy(logits, torch.tensor(targets), reduction="sum").item() for logits, targets in windows)
    return math.exp(nll / sum(len(t) for _, t in windows))


def top1_agreement(windows: list[tuple[torch.Tensor, list[int]]], reference: list[tuple[torch.Tensor, list[int]]]
                   ) -> float:
    same = sum((a.argmax(-1) == b.argmax(-1)).sum().item() for (a, _), (b, _) in zip(windows, reference, strict=True))
    return same / sum(len(t) for _, t in reference)


def greedy(runner: ModelRunner, prompt: list[int], n: int = GREEDY_TOKENS) -> list[int]:
    """n greedy tokens after `prompt`: one prefill, then one-token decode steps over the same slots."""
    tables = _tables(runner, len(prompt) + n)
    logits = runner.execute([SeqChunk(list(prompt), 0, tables, True)])
    out = [int(logits[0].argmax())]
    while len(out) < n:
        logits = runner.execute([SeqChunk([out[-1]], len(prompt) + len(out) - 1, tables, True)])
        out.append(int(logits[0].argmax()))
    return out


def greedy_agreement(outputs: list[list[int]], reference: list[list[int]]) -> dict[str, float]:
    """Prompts whose tokens equal the reference's (a fraction), and the mean count of equal tokens before
    the first difference."""
    prefixes = [next((i for i, (a, b) in enumerate(zip(o, r, strict=True)) if a != b), len(r))
                for o, r in zip(outputs, reference, strict=True)]
    return {"identical": sum(p == len(r) for p, r in zip(prefixes, reference, strict=True)) / len(reference),
            "mean_tokens_before_first_difference": sum(prefixes) / len(prefixes)}


def measure(model_dir: Path, name: str, num_prompts: int = PROMPTS) -> dict:
    """Every figure of the module docstring for one model."""
    ids, seen, starts = held_out_ids(model_dir), seen_ids(model_dir), prompts(model_dir, num_prompts)
    windows, seen_ppl, tokens = {}, {}, {}
    for variant in VARIANTS:
        runner = make_runner(model_dir, variant)
        windows[variant] = window_logits(runner, ids)
        seen_ppl[variant] = perplexity(window_logits(runner, seen))
        tokens[variant] = [greedy(runner, p) for p in starts]
    ppl = {v: perplexity(w) for v, w in windows.items()}
    return {"model": name, "held_out_tokens": len(ids), "prompts": len(starts), "perplexity": ppl,
            "perplexity_vs_float32": {v: ppl[v] / ppl["float32"] - 1 for v in VARIANTS[1:]},
            "seen_perplexity": seen_ppl,
            "seen_perplexity_vs_float32": {v: seen_ppl[v] / seen_ppl["float32"] - 1 for v in VARIANTS[1:]},
            "top1_agreement": {v: top1_agreement(windows[v], windows["float32"]) for v in VARIANTS[1:]},
            f"greedy_{GREEDY_TOKENS}": {v: greedy_agreement(tokens[v], tokens["float32"]) for v in VARIANTS[1:]}}


def _tables(runner: ModelRunner, tokens: int) -> dict[int, list[int]]:
    return {w: list(range(math.ceil(tokens / TPB))) for w in runner.kv.window_sizes}
