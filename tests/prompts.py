"""Token-id prompts for the tests on the built-in tiny models: the same ids on every run.

Tests import it as `from prompts import random_prompt` (tests/ is on sys.path, see hf_reference).
"""

from __future__ import annotations

import random


def random_prompt(seed: int, n: int, low: int = 10, high: int = 500) -> list[int]:
    """`n` ids drawn uniformly from [low, high) by `random.Random(seed)` (the default range is
    inside every tiny model's vocabulary)."""
    rng = random.Random(seed)
    return [rng.randrange(low, high) for _ in range(n)]


def stride_prompt(n: int) -> list[int]:
    """`n` ids in [5, 505) on a stride that depends on `n`: prompts of different lengths (under
    500) differ from their first token on, so a batch of them shares no prefix."""
    return [5 + (n * 13 + j * 29) % 500 for j in range(n)]
