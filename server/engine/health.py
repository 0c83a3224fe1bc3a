"""The engine's own health: periodic checks of its KV invariants, on the engine thread.

A server whose blocks are stranded (held by no live request and no live lease) would answer
`/health` with 200 until its pool ran dry. So every `interval_s`, between steps, the engine compares
what the KV manager counts with what holds blocks:
- `kv_accounting`: `KVCacheManager.check_accounting` (request references counted == those the live
  requests hold; free + in use + cached fit the pool);
- `stranded_requests`: KV requests no scheduler queue knows, or running requests holding no blocks;
- `stranded_pins`: pins on blocks that no live lease holds (only a context server's leases pin), or
  leases whose pins are gone;
- `expired_leases`: leases past their deadline that were never taken back;
- `kv_integrity`: the full `check_integrity` (O(blocks)), only while idle, at most every `full_interval_s`.
A problem counts once it has lasted `grace_s` (so the state between two halves of one hand-over is
none). `problem` (None or a sentence naming the check) is read by the HTTP thread: `/health`
answers 503 with it, and the router fences the server.
"""

from __future__ import annotations

import time
from collections import Counter

from kvcache import KVCacheError

CHECK_INTERVAL_S = 1.0
GRACE_S = 3.0
FULL_CHECK_INTERVAL_S = 60.0
MAX_IDS = 8  # ids named in one message


def _ids(ids) -> str:
    ids = sorted(ids)
    more = f" and {len(ids) - MAX_IDS} more" if len(ids) > MAX_IDS else ""
    return f"{ids[:MAX_IDS]}{more}"


class HealthCheck:
    def __init__(self, interval_s: float = CHECK_INTERVAL_S, grace_s: float = GRACE_S,
                 full_interval_s: float = FULL_CHECK_INTERVAL_S) -> None:
        self.interval_s, self.grace_s, self.full_interval_s = interval_s, grace_s, full_interval_s
        self.problem: str | None = None  # written by the engine thread only
        self.checks = 0
        self._since: dict[str, float] = {}  # kind -> when it was first seen (in a row)
        self._next = 0.0
        self._next_full = 0.0

    def maybe_check(self, core, now: float | None = None) -> None:
        """Run the checks if `interval_s` has passed since the last run (engine thread)."""
        now = time.monotonic() if now is None else now
        if now < self._next:
            return
        self._next = now + self.interval_s
        self.checks += 1
        try:
            found = find_problems(core, now, full=self._full_due(core, now))
        except Exception as exc:  # a bug here must not stop the engine thread, nor pass for health
            found = {"health_check": f"the check itself failed: {type(exc).__name__}: {exc}"}
        self._since = {kind: self._since.get(kind, now) for kind in found}
        lasting = [f"{kind}: {found[kind]}" for kind in sorted(found) if now - self._since[kind] >= self.grace_s]
        self.problem = "; ".join(lasting) or None

    def _full_due(self, core, now: float) -> bool:
        if core.has_work() or now < self._next_full:
            return False
        self._next_full = now + self.full_interval_s
        return True


def find_problems(core, now: float, full: bool = False) -> dict[str, str]:
    """kind -> sentence for every broken invariant of the engine's KV state right now."""
    found: dict[str, str] = {}
    kv = core.kv
    try:
        kv.check_accounting()
        if full:
            kv.check_integrity()
    except KVCacheError as exc:
        found["kv_integrity" if full else "kv_accounting"] = str(exc)
    requests = _request_problem(core)
    if requests:
        found["stranded_requests"] = requests
    sender = getattr(core.connector, "sender", None)  # only a context server's leases pin blocks
    pins = _pin_problem(core, sender.pinned_blocks() if sender is not None else {}, exact=full)
    if pins:
        found["stranded_pins"] = pins
    expired = sender.expired_leases(now) if sender is not None else []
    if expired:
        found["expired_leases"] = f"leases {_ids(expired)} are past their deadline and still pin blocks"
    return found


def _request_problem(core) -> str | None:
    scheduler = core.scheduler
    live = {r.request_id for r in (*scheduler.running, *scheduler.transferring.values())}
    held = set(core.kv.request_ids())
    parts = []
    if held - live:
        parts.append(f"KV requests {_ids(held - live)} hold blocks but are no live request")
    if live - held:
        parts.append(f"live requests {_ids(live - held)} hold no blocks")
    return "; ".join(parts) or None


def _pin_problem(core, expected: dict[int, Counter], exact: bool) -> str | None:
    """Pins the KV manager counts vs pins the leases hold: totals (O(1)) unless `exact` or they
    differ, then block by block (O(blocks))."""
    parts = []
    for window in core.kv.window_sizes:
        want = expected.get(window, Counter())
        if not exact and core.kv.num_pins(window) == want.total():
            continue
        have = core.kv.pinned_blocks(window)
        extra, missing = have - want, want - have
        if extra:
            parts.append(f"window {window}: {extra.total()} pins on blocks {_ids(extra)} held by no live lease")
        if missing:
            parts.append(f"window {window}: leases hold {missing.total()} pins on blocks {_ids(missing)} "
                         "that the KV manager does not count")
    return "; ".join(parts) or None
