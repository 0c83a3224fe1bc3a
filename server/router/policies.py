"""Routing policies behind one small interface: pick a healthy backend, or None."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

from kvcache import block_hashes, request_salt
from server.router.backends import Backend

Backends = Sequence[Backend]
PromptTokens = Callable[[], Sequence[int] | None]  # lazily tokenised prompt (only kv_cache_aware asks)


class Prompt:
    """A request's prompt as kv_cache_aware scores it: tokenised on the first call (then kept), and
    the request's `cache_salt` (a server hashes the prompt's blocks under it: so must the router)."""

    def __init__(self, tokenize: PromptTokens, cache_salt: str | None = None) -> None:
        self._tokenize = tokenize
        self._tokens: list[Sequence[int] | None] = []
        self.cache_salt = cache_salt

    def __call__(self) -> Sequence[int] | None:
        if not self._tokens:
            self._tokens.append(self._tokenize())
        return self._tokens[0]


class RoundRobin:
    def __init__(self) -> None:
        self._counter = itertools.count()

    def pick(self, backends: Backends, prompt: PromptTokens, exclude: set[Backend]) -> Backend | None:
        candidates = [b for b in backends if b.healthy and b not in exclude]
        if not candidates:
            return None
        return candidates[next(self._counter) % len(candidates)]


class LoadBalancing(RoundRobin):
    """Fewest requests in flight; round robin among equals."""

    def pick(self, backends: Backends, prompt: PromptTokens, exclude: set[Backend]) -> Backend | None:
        candidates = [b for b in backends if b.healthy and b not in exclude]
        if not candidates:
            return None
        least = min(b.active for b in candidates)
        return super().pick([b for b in candidates if b.active == least], prompt, set())


class KvCacheAware(LoadBalancing):
    """Longest prompt prefix already cached on a backend (from its reported block hashes), then load."""

    def pick(self, backends: Backends, prompt: PromptTokens, exclude: set[Backend]) -> Backend | None:
        candidates = [b for b in backends if b.healthy and b not in exclude]
        tokens = prompt() if candidates else None
        if not candidates or not tokens:
            return super().pick(candidates, prompt, set())
        salt = getattr(prompt, "cache_salt", None)
        scores = {b: matched_blocks(b, tokens, salt) for b in candidates}
        best = max(scores.values())
        return super().pick([b for b in candidates if scores[b] == best], prompt, set())


def matched_blocks(backend: Backend, tokens: Sequence[int], cache_salt: str | None = None) -> int:
    """How many leading full blocks of `tokens`, hashed under the request's `cache_salt` as the
    servers hash them (kvcache.request_salt), the backend reports as cached."""
    if not backend.cached_hashes or backend.tokens_per_block <= 0:
        return 0
    count = 0
    for digest in block_hashes(tokens, backend.tokens_per_block, request_salt(backend.hash_salt, cache_salt)):
        if digest.hex() not in backend.cached_hashes:
            break
        count += 1
    return count


POLICIES = {"round_robin": RoundRobin, "load_balancing": LoadBalancing, "kv_cache_aware": KvCacheAware}


def make_policy(name: str) -> RoundRobin:
    return POLICIES[name]()
