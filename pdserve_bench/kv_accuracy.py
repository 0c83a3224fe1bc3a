"""What an FP8 KV cache costs in accuracy: perplexity on text the model never saw, and greedy
agreement, against the same model with a cache in its own dtype (scripts/fp8_kv_accuracy.py prints
them; tests/unit/test_fp8_kv_accuracy.py holds them to their bounds).

The held-back text is the prose of standard library modules that `builtin:tiny-story`'s training
corpus (pdserve_bench/tiny_story_corpus.py) leaves out, cut the way the corpus cuts its own. Every
measurement runs through the server's own runner and KV cache (torch attention: an FP8 cache is
read back, dequantized, by every position of a prefill, the chunk's own tokens included).
"""

from __future__ import annotations

import importlib
import inspect
import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from kvcache import KvCacheConfig, KVCacheManager
from pdserve_bench import tiny_story_corpus as corpus
from server.models.kv_format import kv_cache_layout
from server.models.model_spec import load_spec
from server.models.runner import ModelRunner, SeqChunk

# standard library modules whose docstrings the training corpus does not include
HELD_BACK_MODULES = (
    "ast", "bdb", "binascii", "bz2", "code", "codeop", "compileall", "cProfile", "dis", "fileinput", "ftplib",
    "gc", "graphlib", "linecache", "lzma", "pdb", "pkgutil", "plistlib", "profile", "pstats", "py_compile",
    "quopri", "runpy", "socketserver", "ssl", "sys", "sysconfig", "tabnanny", "unicodedata", "xmlrpc.client",
    "zipapp",
)
WINDOW = 512  # tokens a perplexity window holds (each window starts with an empty cache)
TOKENS_PER_BLOCK = 32


def held_back_documents() -> list[str]:
    """One text per held-back module: its prose paragraphs and its public objects', in name order,
    but for the few paragraphs the training corpus has too (docstrings share some boilerplate)."""
    assert not set(HELD_BACK_MODULES) & set(corpus.MODULES)
    trained = {p for d in corpus.documents() for p in d.paragraphs}
    docs = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for name in HELD_BACK_MODULES:
            module = importlib.import_module(name)
            paragraphs = list(corpus.prose_paragraphs(inspect.getdoc(module)))
            for attr in sorted(vars(module)):
                obj = getattr(module, attr)
                if attr.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                    continue
                if inspect.isclass(obj) or inspect.isfunction(obj) or inspect.isbuiltin(obj):
                    paragraphs += corpus.prose_paragraphs(inspect.getdoc(obj))
            paragraphs = [p for p in paragraphs if p not in trained]
            if paragraphs:
                docs.append("\n\n".join(paragraphs))
    return docs


def windows(token_ids: list[int], size: int = WINDOW) -> list[list[int]]:
    """`token_ids` cut into windows of `size` tokens (a shorter last one if it has 2 or more)."""
    return [token_ids[i:i + size] for i in range(0, len(token_ids), size) if len(token_ids[i:i + size]) > 1]


class CacheRun:
    """A runner over a KV cache of `kv` (its dtype and scales) for `model_dir`, float32 on the CPU."""

    def __init__(self, model_dir: Path, kv: KvCacheConfig, max_seq_len: int = 1024, batch: int = 8) -> None:
        spec = load_spec(model_dir)
        tokens = batch * max_seq_len
        config = KvCacheConfig(tokens_per_block=TOKENS_PER_BLOCK, max_tokens=tokens, enable_block_reuse=False,
                               dtype=kv.dtype, scales=kv.scales)
        self.kv = KVCacheManager(config, kv_cache_layout(config, spec, max_seq_len, torch.float32, "cpu"))
        self.runner = ModelRunner(model_dir, self.kv, dtype=torch.float32, device=torch.device("cpu"),
                                  max_num_tokens=max(max_seq_len, batch), max_batch_size=batch, kernels="torch",
                                  max_seq_len=max_seq_len)
        self.eos = list(spec.eos_token_ids)

    def nll(self, window: list[int]) -> tuple[float, int]:
        """Summed negative log-likelihood of window[1:] given what precedes each token, and its count."""
        self.kv.admit("w", window)
        tables = {w: self.kv.slot_table("w", w) for w in self.kv.window_sizes}
        logits = self.runner.execute([SeqChunk(window, 0, tables, True, num_logits=len(window))])
        self.kv.release("w")
        logp = torch.log_softmax(logits[:-1].double(), -1)
        target = torch.tensor(window[1:])
        return float(-logp.gather(1, target[:, None]).sum()), len(window) - 1

    def greedy(self, prompts: list[list[int]], steps: int) -> list[list[int]]:
        """`steps` greedy tokens after each prompt (EOS masked), the prompts decoded as one batch."""
        ids = [f"g{i}" for i in range(len(prompts))]
        for rid, p in zip(ids, prompts, strict=True):
            self.kv.admit(rid, p, num_tokens=len(p) + steps)
        tables = [{w: self.kv.slot_table(rid, w) for w in self.kv.window_sizes} for rid in ids]
        outs: list[list[int]] = [[] for _ in prompts]
        for _ in range(steps):
            chunks = [SeqChunk(p, 0, t, True) if not o else SeqChunk([o[-1]], len(p) + len(o) - 1, t, True)
                      for p, t, o in zip(prompts, tables, outs, strict=True)]
            logits = self.runner.execute(chunks)
            logits[:, self.eos] = float("-inf")
            for out, token in zip(outs, logits.argmax(-1).tolist(), strict=True):
                out.append(token)
        for rid in ids:
            self.kv.release(rid)
        return outs


def perplexity(run: CacheRun, wins: list[list[int]]) -> float:
    total, count = 0.0, 0
    for w in wins:
        nll, n = run.nll(w)
        total, count = total + nll, count + n
    return math.exp(total / count)


@dataclass(frozen=True)
class Agreement:
    """Greedy tokens of one cache against the reference's, over `steps` tokens a prompt."""

    prompts: int
    steps: int
    same_positions: float  # share of (prompt, position) whose token equals the reference's
    common_prefix: float  # mean tokens before the first that differs

    @classmethod
    def of(cls, ref: list[list[int]], got: list[list[int]]) -> Agreement:
        steps = len(ref[0])
        same = sum(a == b for r, g in zip(ref, got, strict=True) for a, b in zip(r, g, strict=True))
        prefix = [next((i for i, (a, b) in enumerate(zip(r, g, strict=True)) if a != b), steps)
                  for r, g in zip(ref, got, strict=True)]
        return cls(len(ref), steps, same / (len(ref) * steps), sum(prefix) / len(prefix))


@dataclass(frozen=True)
class Report:
    tokens: int  # held-back tokens scored
    reference: float  # perplexity with the cache in the model's dtype (float32)
    fp8: float  # with the FP8 cache
    agreement: Agreement  # after prompts of held-back text
    agreement_seen: Agreement  # after prompts of training text (where the model is sure of itself)

    @property
    def relative(self) -> float:
        """(fp8 - reference) / reference."""
        return self.fp8 / self.reference - 1.0


def measure(model_dir: Path, tokenizer, fp8: KvCacheConfig, *, max_tokens: int = 1 << 30,
            prompts: int = 8, steps: int = 64) -> Report:
    """Perplexity of the held-back text (at most `max_tokens` of it) and greedy agreement over
    `steps` tokens after `prompts` prompts: the first 32 tokens of as many held-back documents, and
    of as many training documents (every 100th)."""
    docs = held_back_documents()
    ids = [t for doc in docs for t in tokenizer.encode(doc + "\n\n")][:max_tokens]
    wins = windows(ids)
    unseen = [tokenizer.encode(doc)[:32] for doc in docs[:prompts]]
    seen = [tokenizer.encode(corpus.plain_text(d))[:32] for d in corpus.documents()[::100][:prompts]]
    ref, quant = CacheRun(model_dir, KvCacheConfig()), CacheRun(model_dir, fp8)
    agree = [Agreement.of(ref.greedy(p, steps), quant.greedy(p, steps)) for p in (unseen, seen)]
    return Report(sum(len(w) - 1 for w in wins), perplexity(ref, wins), perplexity(quant, wins), *agree)
