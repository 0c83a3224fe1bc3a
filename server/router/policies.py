"""Routing policies behind one small interface: pick a healthy backend, or None.

- round_robin; load_balancing (fewest legs in flight, round robin among equals);
- kv_cache_aware (docs/ROUTING.md): the highest score

      score(server) = sum over the prompt's leading blocks the server holds of
                      tokens_per_block x kv_weight[tier of the block]  -  load_weight x load_tokens(server)

  from the router's index of the server's cache (`Backend.kv_index`, kept from its KV events) and
  the tokens the router's legs in flight there still have to compute (`Backend.load_tokens`); ties
  go round robin.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

from kvcache import block_hashes, request_salt
from server.config.router import KvWeights, RouterConfig
from server.router.backends import Backend

Backends = Sequence[Backend]
PromptTokens = Callable[[], Sequence[int] | None]  # lazily tokenised prompt (only the kv policies ask)
DEFAULT_KV_WEIGHTS = KvWeights()


class Prompt:
    """A request's prompt as the kv policies score it: tokenised on the first call (then kept), the
    request's `cache_salt` (a server hashes the prompt's blocks under it: so must the router), and
    the tokens it asks for (`max_tokens`, the generation leg's share of a server's load)."""

    def __init__(self, tokenize: PromptTokens, cache_salt: str | None = None, max_tokens: int = 0) -> None:
        self._tokenize = tokenize
        self._tokens: list[Sequence[int] | None] = []
        self._hashes: dict[tuple[str, int], list[bytes]] = {}
        self.cache_salt = cache_salt
        self.max_tokens = max_tokens

    def __call__(self) -> Sequence[int] | None:
        if not self._tokens:
            self._tokens.append(self._tokenize())
        return self._tokens[0]

    def hashes(self, server_salt: str, tokens_per_block: int) -> list[bytes]:
        """Chained hashes of the prompt's full blocks as a server with that salt and block size has them."""
        key = (server_salt, tokens_per_block)
        if key not in self._hashes:
            tokens = self()
            self._hashes[key] = (block_hashes(tokens, tokens_per_block, request_salt(server_salt, self.cache_salt))
                                 if tokens and tokens_per_block > 0 else [])
        return self._hashes[key]


def prompt_length(prompt: PromptTokens) -> int:
    tokens = prompt()
    return len(tokens) if tokens else 0


def hit_tiers(backend: Backend, prompt: PromptTokens) -> list[int]:
    """The tier of each leading block of the prompt that the backend's index says it holds."""
    index = backend.kv_index
    if not index.windows or not isinstance(prompt, Prompt):
        return []
    return index.match(prompt.hashes(index.salt, index.tokens_per_block))


def hit_tokens(backend: Backend, prompt: PromptTokens) -> int:
    """Prompt tokens the backend would reuse, any tier (by its index)."""
    return len(hit_tiers(backend, prompt)) * backend.kv_index.tokens_per_block


def available(backends: Backends, exclude: set[Backend]) -> list[Backend]:
    return [b for b in backends if b.healthy and b not in exclude]


class RoundRobin:
    def __init__(self) -> None:
        self._counter = itertools.count()

    def pick(self, backends: Backends, prompt: PromptTokens, exclude: set[Backend]) -> Backend | None:
        candidates = available(backends, exclude)
        return self._choose(candidates, prompt) if candidates else None

    def _choose(self, candidates: list[Backend], prompt: PromptTokens) -> Backend:
        return candidates[next(self._counter) % len(candidates)]


class LoadBalancing(RoundRobin):
    """Fewest legs in flight; round robin among equals."""

    def _choose(self, candidates: list[Backend], prompt: PromptTokens) -> Backend:
        least = min(b.active for b in candidates)
        return super()._choose([b for b in candidates if b.active == least], prompt)


class KvCacheAware(RoundRobin):
    """The highest tier-weighted hit minus load (module docstring); among equals the fewest legs in
    flight, then round robin (its turn moves only when there is a choice, so that requests which go
    where their prefix is do not skew the turns of those that may go anywhere)."""

    def __init__(self, kv_weights: KvWeights = DEFAULT_KV_WEIGHTS, load_weight: float = 1.0) -> None:
        super().__init__()
        self.kv_weights, self.load_weight = kv_weights, load_weight

    def score(self, backend: Backend, prompt: PromptTokens) -> float:
        tpb = backend.kv_index.tokens_per_block
        hit = sum(tpb * self.kv_weights.tier(level) for level in hit_tiers(backend, prompt))
        return hit - self.load_weight * backend.load_tokens

    def _choose(self, candidates: list[Backend], prompt: PromptTokens) -> Backend:
        scores = {b: self.score(b, prompt) for b in candidates}
        best = max(scores.values())
        tied = [b for b in candidates if scores[b] == best]
        least = min(b.active for b in tied)
        tied = [b for b in tied if b.active == least]
        return tied[0] if len(tied) == 1 else super()._choose(tied, prompt)


def make_policy(config: RouterConfig) -> RoundRobin:
    """`router.type`'s policy, with its weights."""
    if config.type == "kv_cache_aware":
        return KvCacheAware(config.kv_weights, config.load_weight)
    return {"round_robin": RoundRobin, "load_balancing": LoadBalancing}[config.type]()
