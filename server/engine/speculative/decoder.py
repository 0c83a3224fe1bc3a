"""The engine's speculation policy: who drafts in a step, how many tokens, and what a verify emits.

`SpecDecoder.draft` turns decode chunks into verify chunks (the last sampled token + k drafts, blocks
reserved for all 1+k positions); `rows` gives the sampler one row per verify position; `accept` picks
the emitted tokens (verify.py says why the output is unchanged). The engine rolls the computed count
back over rejected drafts: their K/V is overwritten when those positions are computed again, and only
known (accepted) ids are ever hashed into the prefix cache (`scheduler.committable`).

Adaptive: a request that drafts nothing or has nothing accepted `MISS_LIMIT` times in a row pauses
for `backoff` output tokens, doubled at each pause up to `MAX_BACKOFF` (random text costs a few verify
steps in hundreds) and halved by each accepted draft; a new request starts paused longer while drafts
are rarely accepted server-wide. A step that decodes more than `max_decode_batch` requests drafts
nothing (a large batch is compute-bound). `NoSpeculation` is the null policy (`method: off`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, replace
from typing import Protocol

from kvcache import KVCacheManager, OutOfBlocksError
from server.engine.request import Request, Status
from server.engine.scheduler import ScheduledChunk, SchedulerConfig
from server.engine.speculative.config import SpeculativeConfig
from server.engine.speculative.draft_model import build_draft_drafter
from server.engine.speculative.ngram import NgramDrafter
from server.engine.speculative.verify import VerifyRow, accepted_prefix, sampling_rows
from server.telemetry.metrics import SpecCounts

MISS_LIMIT = 2
MIN_BACKOFF = 8
MAX_BACKOFF = 256
GLOBAL_ALPHA = 0.05  # weight of one verify in the server-wide acceptance average
GLOBAL_POOR = 0.1  # below this server-wide acceptance, new requests start paused longer


class Drafter(Protocol):
    def propose(self, requests: list[Request], ks: list[int]) -> list[list[int]]:
        """Up to ks[i] draft tokens to follow requests[i]'s known tokens (its all_token_ids)."""
        ...


@dataclass
class _Pace:
    backoff: int
    misses: int = 0
    resume_at: int = 0  # drafting resumes once the request has this many output tokens


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, limits: SchedulerConfig, drafter: Drafter) -> None:
        self.config, self.limits, self.drafter = config, limits, drafter
        self.stats = SpecCounts()  # cumulative, for /metrics
        self._paces: weakref.WeakKeyDictionary[Request, _Pace] = weakref.WeakKeyDictionary()
        self._global = 1.0  # server-wide acceptance average (optimistic until verifies say otherwise)

    # ---- before the step
    def wants_tokens(self, requests: list[Request]) -> bool:
        """Async scheduling: some request of the step in flight will draft next, so its token must
        be on the host before the schedule (the step is postprocessed first). A constrained request
        never drafts (`_may_draft`): its token goes to its grammar with the step in flight
        (`StructuredOutput.feed_ahead`), the step's tokens read while the next forward runs."""
        if len(requests) > self.config.max_decode_batch:
            return False
        return any(r.status == Status.RUNNING and not r.is_context_only and r.grammar is None
                   and len(r.output_token_ids) + 1 >= self._pace(r).resume_at for r in requests)

    def draft(self, chunks: list[ScheduledChunk], kv: KVCacheManager) -> list[ScheduledChunk]:
        """The step's chunks, those of drafting requests with their drafts and blocks for them."""
        decoding = sum(1 for c in chunks if c.num_new_tokens == 1)
        candidates = [c for c in chunks if self._may_draft(c)] if decoding <= self.config.max_decode_batch else []
        if not candidates:
            return chunks
        budget = self.limits.max_num_tokens - sum(c.num_new_tokens for c in chunks)
        requests = [c.request for c in candidates]
        proposals = self.drafter.propose(requests, [self._room(r) for r in requests])
        drafts: dict[Request, tuple[int, ...]] = {}
        for request, proposal in zip(requests, proposals, strict=True):
            if not proposal:
                self._observe(request, 0)
            elif budget > 0 and _reserve(kv, request, len(proposal[:budget])):
                drafts[request] = tuple(proposal[:budget])
                budget -= len(drafts[request])
        return [replace(c, num_new_tokens=1 + len(drafts[c.request]), drafts=drafts[c.request]) if c.request in drafts
                else c for c in chunks]

    def rows(self, chunks: list[ScheduledChunk]) -> list[Request | VerifyRow]:
        """The sampler's rows of the chunks that want logits: one per verify position."""
        return [row for c in chunks for row in sampling_rows(c.request, c.drafts)]

    # ---- after the step
    def accept(self, request: Request, drafts: tuple[int, ...], targets: list[int]) -> list[int]:
        """The tokens a verify chunk emits (accepted drafts + one)."""
        a = accepted_prefix(drafts, targets)
        s = self.stats
        self.stats = SpecCounts(s.proposed + len(drafts), s.accepted + a, s.emitted + a + 1, s.verified + 1)
        self._global += GLOBAL_ALPHA * (a / len(drafts) - self._global)
        self._observe(request, a)
        return list(targets[:a + 1])

    # ---- pace
    def _may_draft(self, chunk: ScheduledChunk) -> bool:
        request = chunk.request
        return (chunk.num_new_tokens == 1 and chunk.need_logits and not request.num_pending
                and not request.is_context_only and request.grammar is None  # structured output: no drafts
                and self._room(request) > 0
                and len(request.output_token_ids) >= self._pace(request).resume_at)

    def _room(self, request: Request) -> int:
        """Drafts that can all be emitted: within max_tokens and max_seq_len, the bonus token counted."""
        left = min(request.sampling.max_tokens - len(request.output_token_ids),
                   self.limits.max_seq_len - request.num_tokens)
        return max(0, min(self.config.num_speculative_tokens, left - 1))

    def _pace(self, request: Request) -> _Pace:
        pace = self._paces.get(request)
        if pace is None:
            pace = self._paces[request] = _Pace(MIN_BACKOFF if self._global >= GLOBAL_POOR else 4 * MIN_BACKOFF)
        return pace

    def _observe(self, request: Request, accepted: int) -> None:
        pace = self._pace(request)
        if accepted:
            pace.misses, pace.backoff = 0, max(MIN_BACKOFF, pace.backoff // 2)
            return
        pace.misses += 1
        if pace.misses >= MISS_LIMIT:
            pace.misses, pace.resume_at = 0, len(request.output_token_ids) + pace.backoff
            pace.backoff = min(2 * pace.backoff, MAX_BACKOFF)


def _reserve(kv: KVCacheManager, request: Request, num_drafts: int) -> bool:
    """Blocks for the verify chunk's 1 + num_drafts positions; none free: no drafts (never a preemption)."""
    try:
        kv.extend(request.request_id, request.num_computed_tokens + 1 + num_drafts)
    except OutOfBlocksError:
        return False
    return True


class NoSpeculation:
    """`method: off`: every step is a plain step."""

    stats = SpecCounts()

    def wants_tokens(self, requests: list[Request]) -> bool:
        return False

    def draft(self, chunks: list[ScheduledChunk], kv: KVCacheManager) -> list[ScheduledChunk]:
        return chunks

    def rows(self, chunks: list[ScheduledChunk]) -> list[Request | VerifyRow]:
        return [c.request for c in chunks]

    def accept(self, request: Request, drafts: tuple[int, ...], targets: list[int]) -> list[int]:
        raise AssertionError("no verify chunk without speculation")


def build_spec(config: SpeculativeConfig, limits: SchedulerConfig, runner=None) -> SpecDecoder | NoSpeculation:
    """The policy a server's `speculative:` section asks for. `runner`: the target's model runner (a draft
    model runs on its device, in its dtype)."""
    if config.method == "ngram":
        return SpecDecoder(config, limits, NgramDrafter(config.ngram_min, config.ngram_max))
    if config.method == "draft_model":
        drafter = build_draft_drafter(config.draft_model, runner, limits.max_seq_len, 2 * config.max_decode_batch)
        return SpecDecoder(config, limits, drafter)
    return NoSpeculation()
