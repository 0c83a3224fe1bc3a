"""The context side's streamed leases, on its socket thread: which blocks of a pull can go out now,
and the test-only model of a slow link (`Pacer`).

A streamed lease is offered when its request starts to prefill (`Offer.final` False): every block
is PENDING until the engine's `Extend` brings its primary slot, once the prefill step that wrote it
has run. A pull of it is served as far as the slots go (`next_ranges`) and waits for the next
`Extend` when it has caught up; after the final one it ends with a `Done` that carries the first
token and the prefix hit. So only the last chunk's blocks are left after the first token.
"""

from __future__ import annotations

import time

from transceiver.sender.lease import PENDING, RELEASED, Job, Offered
from transceiver.wire import WindowRange


def next_ranges(off: Offered, job: Job) -> tuple[list[WindowRange], str | None]:
    """The blocks of `job`'s ranges that became sendable since it last looked (it moves on past
    them), or a sentence when a block it asked for was released or never came."""
    out = []
    for i, r in enumerate(job.ranges):
        slots, start, stop = off.offer.windows[r.window].slots, job.planned[i], r.first + r.count
        end = start
        while end < stop and slots[end] != PENDING:
            if slots[end] == RELEASED:
                return out, f"window {r.window}: block {end} left the sliding window and was released"
            end += 1
        if end < stop and off.final:
            return out, f"window {r.window}: block {end} was never written"
        if end > start:
            out.append(WindowRange(window=r.window, first=start, count=end - start))
        job.planned[i] = end
    return out, None


def complete(off: Offered, job: Job) -> bool:
    """Every block the pull asked for is planned, and nothing more will come."""
    return off.final and all(p == r.first + r.count for p, r in zip(job.planned, job.ranges, strict=True))


class Pacer:
    """Test-only (cache_transceiver_config.test_link_delay_ms / test_link_bytes_per_s): the byte path
    sends its next chunk only once the one before would have crossed a link with this latency per
    message and this bandwidth, so a CPU test can show a transfer overlapping the prefill. The
    socket thread does not sleep: `pump` is called again when the link is free."""

    def __init__(self, delay_ms: float = 0.0, bytes_per_s: int = 0) -> None:
        self._delay_s = delay_ms / 1000.0
        self._bytes_per_s = bytes_per_s
        self._free_at = 0.0

    @property
    def enabled(self) -> bool:
        return self._delay_s > 0 or self._bytes_per_s > 0

    def wait_s(self) -> float:
        """Seconds until the link takes the next chunk (0: now)."""
        return max(0.0, self._free_at - time.monotonic()) if self.enabled else 0.0

    def sent(self, nbytes: int) -> None:
        if not self.enabled:
            return
        wire = self._delay_s + (nbytes / self._bytes_per_s if self._bytes_per_s else 0.0)
        self._free_at = max(time.monotonic(), self._free_at) + wire
