"""The n-gram (prompt lookup) drafter: no model, strong where the answer copies the prompt.

For a sequence t[0..L) it takes the longest suffix t[L-n..L), n from `ngram_max` down to `ngram_min`,
that also occurs earlier, and proposes the k tokens that followed its most recent earlier occurrence.
`NgramIndex` keeps, per n, each n-gram's most recent start among those that have a next token, so a
lookup is one dict probe per n and a step adds only the n-grams its new tokens completed.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence


class NgramIndex:
    """Index of one growing token sequence (a request's prompt + output; ids are only appended)."""

    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.sizes = range(ngram_max, ngram_min - 1, -1)  # longest first
        self._starts: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self._indexed = 0  # t[:_indexed] is indexed: every n-gram ending before t[_indexed - 1]

    def update(self, tokens: Sequence[int]) -> None:
        """Index the n-grams that now have a next token: those ending at positions < len(tokens) - 1."""
        last = len(tokens) - 1
        for end in range(max(self._indexed, 1), last + 1):  # n-grams t[end-n..end) followed by t[end]
            for n, starts in self._starts.items():
                if end >= n:
                    starts[tuple(tokens[end - n:end])] = end - n
        self._indexed = max(self._indexed, last + 1)

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that followed the longest earlier occurrence of a suffix of `tokens`."""
        if k <= 0:
            return []
        self.update(tokens)
        for n in self.sizes:
            if len(tokens) <= n:
                continue
            start = self._starts[n].get(tuple(tokens[-n:]))
            if start is not None:
                return list(tokens[start + n:start + n + k])
        return []


class NgramDrafter:
    """The `Drafter` of `method: ngram`: one `NgramIndex` per live request (dropped with it)."""

    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self._indexes: weakref.WeakKeyDictionary[object, NgramIndex] = weakref.WeakKeyDictionary()

    def propose(self, requests: list, ks: list[int]) -> list[list[int]]:
        return [self._index(r).propose(r.all_token_ids, k) for r, k in zip(requests, ks, strict=True)]

    def _index(self, request) -> NgramIndex:
        index = self._indexes.get(request)
        if index is None:
            index = self._indexes[request] = NgramIndex(self.ngram_min, self.ngram_max)
        return index
