"""Picking the server of one leg: the policy's choice among unsaturated servers, or a wait in a
bounded queue when every server is saturated (`max_inflight_per_server` legs in flight; 0: never).

A waiting leg is served first come first served; a full queue or a wait beyond `timeout_s` is a 503
(`router_queue_full` / `router_queue_timeout`). Every leg holds a `Booking` from its pick until it
ends: the router's in-flight accounting (`Backend.active`, `Backend.load_tokens`)."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from contextlib import suppress

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from server.config.router import QueueLimits
from server.openai.errors import error_body
from server.router.backends import Backend
from server.router.errors import LegError
from server.router.policies import Backends, PromptTokens, RoundRobin, available, hit_tokens, prompt_length

RECHECK_S = 0.5  # a waiting leg looks again this often (a fenced server may have come back)
WAIT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Booking:
    """One leg on one server, from its pick until `done()` (idempotent)."""

    def __init__(self, backend: Backend, tokens: int, on_done: Callable[[], None]) -> None:
        self.backend, self.tokens = backend, tokens
        self._on_done: Callable[[], None] | None = on_done
        backend.active += 1
        backend.load_tokens += tokens

    def done(self) -> bool:
        """True the first time (the booking ended now)."""
        on_done, self._on_done = self._on_done, None
        if on_done is None:
            return False
        self.backend.active -= 1
        self.backend.load_tokens -= self.tokens
        on_done()
        return True


class QueueMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.depth = Gauge("pdserve_router_queue_depth", "Legs waiting in the router queue for an unsaturated "
                           "server, by leg", ["leg"], registry=registry)
        self.wait = Histogram("pdserve_router_queue_wait_seconds", "Time a leg waited in the router queue "
                              "(legs that found a server at once are not counted), by leg", ["leg"],
                              buckets=WAIT_BUCKETS, registry=registry)
        self.rejected = Counter("pdserve_router_queue_rejected", "Legs refused with 503 by the router queue, "
                                "by leg and reason (full, timeout)", ["leg", "reason"], registry=registry)


class LegPicker:
    """The server of one kind of leg ("context" or "generation"): policy + saturation + queue."""

    def __init__(self, leg: str, policy: RoundRobin, limits: QueueLimits, metrics: QueueMetrics,
                 decodes: bool = False) -> None:
        self.leg, self.policy, self.limits, self.metrics = leg, policy, limits, metrics
        self.decodes = decodes  # generation legs: their load is the whole context they decode with
        self._waiters: deque[asyncio.Event] = deque()

    def saturated(self, backend: Backend) -> bool:
        limit = self.limits.max_inflight_per_server
        return limit > 0 and backend.active >= limit

    def book(self, backends: Backends, prompt: PromptTokens, exclude: set[Backend]) -> Booking | None:
        """A booking on the policy's choice among the unsaturated servers now (None: none), for its load:
        a context leg, the prompt tokens it must prefill there (those not cached); a generation leg,
        prompt + max_tokens, the KV it holds and attends to while it decodes (Dynamo's "active blocks")."""
        backend = self.policy.pick([b for b in backends if not self.saturated(b)], prompt, exclude)
        if backend is None:
            return None
        if self.decodes:
            tokens = prompt_length(prompt) + getattr(prompt, "max_tokens", 0)
        else:
            tokens = max(0, prompt_length(prompt) - hit_tokens(backend, prompt))
        return Booking(backend, tokens, self._wake_first)

    async def pick(self, backends: Backends, prompt: PromptTokens, exclude: set[Backend]) -> Booking | None:
        """A booking on the policy's choice; None when no healthy server is left. Waits while every
        candidate is saturated; LegError 503 when the queue is full or the wait times out."""
        if not available(backends, exclude):
            return None
        if not self._waiters and (booking := self.book(backends, prompt, exclude)) is not None:
            return booking
        if len(self._waiters) >= self.limits.max_waiting:
            self.metrics.rejected.labels(self.leg, "full").inc()
            raise self._refused("router_queue_full", f"the router queue is full ({len(self._waiters)} "
                                f"{self.leg} legs waiting)")
        return await self._wait(backends, prompt, exclude)

    async def _wait(self, backends: Backends, prompt: PromptTokens, exclude: set[Backend]) -> Booking | None:
        me, start = asyncio.Event(), time.monotonic()
        self._waiters.append(me)
        self.metrics.depth.labels(self.leg).set(len(self._waiters))
        try:
            while True:
                if self._waiters[0] is me:
                    if not available(backends, exclude):
                        return None
                    if (booking := self.book(backends, prompt, exclude)) is not None:
                        return booking
                remaining = start + self.limits.timeout_s - time.monotonic()
                if remaining <= 0:
                    self.metrics.rejected.labels(self.leg, "timeout").inc()
                    raise self._refused("router_queue_timeout", f"waited {self.limits.timeout_s:g} s in the "
                                        "router queue")
                me.clear()
                with suppress(TimeoutError):
                    await asyncio.wait_for(me.wait(), min(remaining, RECHECK_S))
        finally:
            self._waiters.remove(me)
            self.metrics.depth.labels(self.leg).set(len(self._waiters))
            self.metrics.wait.labels(self.leg).observe(time.monotonic() - start)
            self._wake_first()  # the next in line may find room too (or must see that none is left)

    def _wake_first(self) -> None:
        if self._waiters:
            self._waiters[0].set()

    def _refused(self, code: str, what: str) -> LegError:
        limit = self.limits.max_inflight_per_server
        message = (f"{self.leg} leg refused: every healthy {self.leg} server is saturated ({limit} legs in "
                   f"flight each) and {what}; try again later")
        return LegError(503, message, error_body(503, message, code=code))
