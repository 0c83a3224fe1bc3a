"""Benchmark workloads: lists of prompt token ids plus an output length, drawn with a fixed seed.

Prompts are token ids (not text), so the server, the HF baseline and every repeat see exactly the
same tokens with no re-tokenization. Special ids (bos/eos/pad/chat markers) are never drawn.
Each repeat of a figure uses a different seed: a repeated prompt would hit the prefix cache of the
previous repeat and measure the cache instead of the engine.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]
    max_tokens: int  # every request generates exactly this many tokens (ignore_eos)

    @property
    def input_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def usable_token_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Every id of the vocabulary except the special ones, ascending."""
    special = set(tokenizer.all_special_ids)
    return [i for i in range(len(tokenizer)) if i not in special]


def _draw(rng: random.Random, vocab: Sequence[int], n: int) -> list[int]:
    return [vocab[rng.randrange(len(vocab))] for _ in range(n)]


def random_workload(
    vocab: Sequence[int], *, num_prompts: int, input_len: int, output_len: int, seed: int
) -> Workload:
    """`num_prompts` independent prompts of exactly `input_len` random tokens."""
    rng = random.Random(seed)
    prompts = [_draw(rng, vocab, input_len) for _ in range(num_prompts)]
    return Workload(f"random-{input_len}in-{output_len}out", prompts, output_len)


@dataclass(frozen=True)
class SharedPrefixShape:
    """SGLang's generated-shared-prefix workload, scaled for 2 cores (research/perf.md §2 CPU 4)."""

    groups: int = 16
    prompts_per_group: int = 8
    prefix_len: int = 512
    question_len: int = 32
    output_len: int = 32


def shared_prefix_workload(vocab: Sequence[int], shape: SharedPrefixShape, *, seed: int) -> Workload:
    """`groups` x `prompts_per_group` prompts; the prompts of a group share a `prefix_len` prefix.

    The order is shuffled with the seed, so at concurrency > 1 the requests of one group are spread
    over the run (as in a real mixed stream) instead of all arriving before the first one finished.
    """
    rng = random.Random(seed)
    prompts = []
    for _ in range(shape.groups):
        prefix = _draw(rng, vocab, shape.prefix_len)
        prompts += [prefix + _draw(rng, vocab, shape.question_len) for _ in range(shape.prompts_per_group)]
    rng.shuffle(prompts)
    name = f"shared-prefix-{shape.groups}x{shape.prompts_per_group}-{shape.prefix_len}+{shape.question_len}in"
    return Workload(f"{name}-{shape.output_len}out", prompts, shape.output_len)
