"""Token timings for the engine's metrics: stamped when a token is accepted, handed to the metrics
later (`observe`, between steps or while the GPU computes), so the step's hot path only appends. The
server-side phases of a request's time to first token (docs/DISAGG_LOAD.md) are observed once per
request: its queue time (arrival -> first admission) and, where its prompt is computed, its prefill
(first admission -> first token sampled)."""

from __future__ import annotations

import time

from server.engine.request import Request


class TokenTimings:
    def __init__(self, metrics=None) -> None:
        self.metrics = metrics  # ServerMetrics or None
        self._pending: list[tuple[bool, float]] = []  # (first token?, seconds) not yet observed
        self._prompt_tokens = 0  # prompt tokens of first tokens not yet counted
        self._prefills: list[float] = []  # first admission -> first token, not yet observed

    def stamp(self, request: Request) -> None:
        """A new token of `request` now: its TTFT or its time since the token before."""
        now = time.monotonic()
        if request.first_token_time is None:
            self._pending.append((True, now - request.arrival_time))
            if not request.is_generation_only and request.parent is None:  # its prompt was computed here (once)
                self._prompt_tokens += request.num_prompt_tokens
                self._prefills.append(now - (request.scheduled_time or now))
        else:
            self._pending.append((False, now - request.last_token_time))
        request.first_token_time = request.first_token_time or now
        request.last_token_time = now

    def observe(self) -> None:
        timings, self._pending = self._pending, []
        prompt_tokens, self._prompt_tokens = self._prompt_tokens, 0
        prefills, self._prefills = self._prefills, []
        if self.metrics is None:
            return
        if prompt_tokens:
            self.metrics.add_prompt_tokens(prompt_tokens)
        for seconds in prefills:
            self.metrics.observe_prefill(seconds)
        for first, seconds in timings:
            (self.metrics.observe_ttft if first else self.metrics.observe_tpot)(seconds)
        if timings:
            self.metrics.add_generation_tokens(len(timings))

    def finished(self, request: Request) -> None:
        """End-to-end latency (arrival to the last output here) and queue time (arrival to the
        first admission) of a request that ended on this server, whatever the reason; of n choices,
        the first's (one observation per request)."""
        if self.metrics is None or request.parent is not None:
            return
        now = time.monotonic()
        self.metrics.observe_e2e(now - request.arrival_time)
        if request.scheduled_time is not None:
            self.metrics.observe_queue_time(request.scheduled_time - request.arrival_time)
