"""Benchmark workloads: lists of prompt token ids plus an output length, drawn with a fixed seed.

Prompts are token ids (not text), so the server, the HF baseline and every repeat see exactly the
same tokens with no re-tokenization. Special ids (bos/eos/pad/chat markers) are never drawn.
Each repeat of a figure uses a different seed: a repeated prompt would hit the prefix cache of the
previous repeat and measure the cache instead of the engine.

A workload is a list of sessions: the prompts of one session are sent one after the other (a
conversation's turns), different sessions run side by side up to the concurrency. Random,
shared-prefix and grid workloads have one prompt per session.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]
    max_tokens: int  # every request generates exactly this many tokens (ignore_eos)
    # indices into `prompts`, one list per session, sent in order; None: every prompt is its own session
    sessions: tuple[tuple[int, ...], ...] | None = None

    @property
    def input_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    def session_list(self) -> list[tuple[int, ...]]:
        return list(self.sessions) if self.sessions is not None else [(i,) for i in range(len(self.prompts))]


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


@dataclass(frozen=True)
class MultiTurnShape:
    """Chat replay: each turn's prompt is the previous prompt + that turn's replayed answer + a new
    user message, so every turn extends the last (the prefix cache, and with a small primary pool the
    host tier, decide how much of it is recomputed). The answer is replayed from the workload (random
    tokens of `output_len`), not taken from the server, as a recorded conversation would be."""

    conversations: int = 8
    turns: int = 4
    user_len: int = 128  # new user tokens per turn
    output_len: int = 32  # tokens generated per turn, and the replayed answer's length


def multi_turn_workload(vocab: Sequence[int], shape: MultiTurnShape, *, seed: int) -> Workload:
    """`conversations` sessions of `turns` prompts; turn t+1 starts with the whole of turn t's prompt."""
    rng = random.Random(seed)
    prompts: list[list[int]] = []
    sessions = []
    for _ in range(shape.conversations):
        history: list[int] = []
        indices = []
        for turn in range(shape.turns):
            if turn:
                history = history + _draw(rng, vocab, shape.output_len)  # the replayed answer to the last turn
            history = history + _draw(rng, vocab, shape.user_len)
            indices.append(len(prompts))
            prompts.append(history)
        sessions.append(tuple(indices))
    name = f"multi-turn-{shape.conversations}x{shape.turns}-{shape.user_len}user-{shape.output_len}out"
    return Workload(name, prompts, shape.output_len, tuple(sessions))


# The input/output lengths peers publish for prefill/decode disaggregation (tokens).
LENGTH_GRID: tuple[tuple[str, int, int], ...] = (
    ("1k/1k", 1024, 1024),
    ("8k/1k", 8192, 1024),
    ("1k/8k", 1024, 8192),
    ("8k/256", 8192, 256),  # prefill-heavy
)


@dataclass(frozen=True)
class GridPoint:
    label: str  # the full-size name, e.g. "8k/1k"
    input_len: int
    output_len: int


def parse_scale(text: str) -> Fraction:
    """`1/16`, `0.0625` or `1` -> a positive fraction at most 1."""
    try:
        scale = Fraction(text)
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"--scale wants a fraction like 1/16 or 0.25, got {text!r}") from None
    if not 0 < scale <= 1:
        raise ValueError(f"--scale must be in (0, 1], got {text}")
    return scale


def length_grid(scale: Fraction = Fraction(1)) -> list[GridPoint]:
    """The peers' grid with both lengths multiplied by `scale` (at least 1 token each)."""
    return [GridPoint(label, max(1, round(i * scale)), max(1, round(o * scale))) for label, i, o in LENGTH_GRID]
