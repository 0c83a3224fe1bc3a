"""One server's KV event feed as the router follows it: the state machine that keeps a `KvIndex`
right (no I/O here; server/router/kv_sync.py drives it).

    idle --subscribed--> subscribing --first batch--> syncing --snapshot--> live
                                                         ^                    |
                                                         +---- gap, epoch ----+

The snapshot is asked only after the first batch (then no later event can be missed); batches that
arrive meanwhile are replayed from the snapshot's `seq + 1`. A gap, another epoch or another KV
dtype asks for a resync."""

from __future__ import annotations

from dataclasses import dataclass, field

from server.router.kv_index import KvIndex
from server.telemetry.kv_events import KvEventBatch

MAX_PENDING_BATCHES = 10_000  # kept while a snapshot is on its way; beyond: start over


@dataclass
class KvFeed:
    index: KvIndex = field(default_factory=KvIndex)
    state: str = "idle"  # idle | subscribing | syncing | live
    epoch: str = ""
    next_seq: int = 0
    pending: list[tuple[str, KvEventBatch]] = field(default_factory=list)
    events_applied: int = 0
    resyncs: dict[str, int] = field(default_factory=dict)  # reason -> count

    def subscribed(self) -> None:
        self.state, self.pending = "subscribing", []

    def stop(self) -> None:
        """The server is gone or fenced: forget its blocks until a new feed is synced."""
        self.state, self.pending = "idle", []
        self.index.clear()

    def on_batch(self, epoch: str, batch: KvEventBatch) -> bool:
        """Take one batch; True when a snapshot must be fetched now (call `on_snapshot` with it)."""
        if self.state == "subscribing":
            self.state, self.pending = "syncing", [(epoch, batch)]
            return True
        if self.state == "syncing":
            self.pending.append((epoch, batch))
            if len(self.pending) > MAX_PENDING_BATCHES:
                return self._resync("overflow")
            return False
        if self.state != "live":
            return False
        if epoch != self.epoch:
            return self._resync("epoch")
        if batch.kv_dtype and self.index.kv_dtype and batch.kv_dtype != self.index.kv_dtype:
            return self._resync("kv_dtype")
        if batch.first_seq > self.next_seq:
            return self._resync("gap")
        self._apply(batch)
        return False

    def on_snapshot(self, snapshot: dict) -> bool:
        """Reset the index to a snapshot and replay what came after it; True: fetch another one
        (the kept batches do not continue it). Raises ValueError/KeyError/TypeError if malformed."""
        if self.state != "syncing":
            return False
        epoch, seq = snapshot["epoch"], int(snapshot["seq"])
        self.index.reset(snapshot)
        pending, self.pending = self.pending, []
        self.state, self.epoch, self.next_seq = "live", epoch, seq + 1
        # Every kept batch was drained on the server before the snapshot was taken, so a batch that
        # does not continue it (another epoch, a gap) means only that another snapshot is needed.
        return any(self.on_batch(batch_epoch, batch) for batch_epoch, batch in pending)

    def _apply(self, batch: KvEventBatch) -> None:
        skip = self.next_seq - batch.first_seq  # events already applied (a repeated batch)
        index = self.index
        for window, kind, block_hash, level in batch.events[skip:]:
            index.apply(window, kind, block_hash, level)
        self.events_applied += max(0, len(batch.events) - skip)
        self.next_seq = max(self.next_seq, batch.first_seq + len(batch.events))

    def _resync(self, reason: str) -> bool:
        self.resyncs[reason] = self.resyncs.get(reason, 0) + 1
        self.state, self.pending = "syncing", []
        return True
