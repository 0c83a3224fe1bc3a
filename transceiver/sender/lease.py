"""One leased context request as each of the sender's threads sees it: the engine's `Lease` (blocks
pinned, deadline) and the socket thread's `Offered` (their primary slots, the pulls serving them).
The engine never reads a lease's slot memory, the socket thread never touches the KV manager; the
engine unpins only after `Ended`. A streamed lease's blocks are PENDING until an `Extend` (stream.py).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq

from transceiver.wire import WindowRange


@dataclass
class Lease:
    deadline: float  # monotonic; a pull that starts renews it
    pinned: dict[int, list[int]]
    withdrawn: bool = False  # the engine ended it; waiting for the socket thread's `Ended`


RELEASED = -1  # a slot of a block that left the sliding window: never sent
PENDING = -2  # a streamed lease's block that its prefill has not completed yet


def ready_event(pools: dict[int, torch.Tensor]) -> torch.cuda.Event | None:
    """A CUDA event after every write to the pools issued so far; None for CPU pools."""
    pool = next(iter(pools.values()))
    if not pool.is_cuda:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(pool.device))
    return event


@dataclass(frozen=True)
class OfferedWindow:
    pool: torch.Tensor  # the window's primary pool [num_slots, layers, 2, tpb, heads, dim]
    slots: list[int]  # primary slot of block i, RELEASED or (streamed, socket thread fills it) PENDING
    slot_bytes: int


@dataclass(frozen=True)
class Offer:
    """Engine -> socket thread: serve pulls of `cid` from these slots."""

    cid: str
    windows: dict[int, OfferedWindow]
    ready: Any = None  # torch.cuda.Event after the writes to these slots (onboard copies), or None
    final: bool = True  # False: a streamed lease, whose `Extend`s follow


@dataclass(frozen=True)
class Extend:
    """Engine -> socket thread: more written blocks of streamed lease `cid` (window -> (first block
    index, primary slots)); `final`: the prefill is over."""

    cid: str
    windows: dict[int, tuple[int, list[int]]]
    ready: Any = None  # torch.cuda.Event after the prefill step that wrote them, or None
    final: bool = False
    first_tokens: tuple[int, ...] = ()
    cached_tokens: int = 0


@dataclass(frozen=True)
class Withdraw:
    """Engine -> socket thread: the lease ended (expired, aborted, closing); a running pull fails."""

    cid: str
    reason: str
    detail: str


@dataclass(frozen=True)
class Started:
    """Socket thread -> engine: a pull of `cid` began (the lease is renewed)."""

    cid: str


@dataclass(frozen=True)
class Ended:
    """Socket thread -> engine: `cid`'s slots are read no more, once zmq released `trackers`."""

    cid: str
    trackers: list[zmq.MessageTracker]


@dataclass
class Job:
    """One pull being served: chunks left to send, then Done, then waiting for the Ack."""

    peer: bytes  # ROUTER identity of the receiver
    pull_id: int
    chunks: deque[WindowRange]  # one chunk message each
    started: float  # monotonic
    sent_bytes: int = 0
    sent_chunks: int = 0
    done_sent: bool = False  # an Ack now ends the pull (and, unless keep_lease, the lease)
    heads: tuple[int, int] | None = None  # the kv heads sent of each block (None: whole slots)
    keep_lease: bool = False  # the lease outlives this pull's Ack (a part of a tensor-parallel pull)
    ranges: list[WindowRange] = field(default_factory=list)  # what the pull asked for
    planned: list[int] = field(default_factory=list)  # per range: the next block not yet planned
    via_ipc: bool = False
    target: int = 0  # chunk size aimed at (bytes)
    queued: bool = False  # in the server's active queue (byte path) or its last IPC batch queued


@dataclass
class Offered:
    """Socket side of a lease: one pull at a time, or one `keep_lease` part per receiver."""

    offer: Offer
    jobs: dict[int, Job] = field(default_factory=dict)  # by pull_id
    pool_frames: list[zmq.MessageTracker] = field(default_factory=list)  # zero-copy frames of its slots
    final: bool = True  # every slot is known (a streamed lease: after its final `Extend`)
    ready: Any = None  # the latest `ready` event: reads wait for it
    first_tokens: tuple[int, ...] = ()
    cached_tokens: int = 0

    def __post_init__(self) -> None:
        self.final, self.ready = self.offer.final, self.offer.ready

    def extend(self, ext: Extend) -> None:
        """Take the slots (and, when final, the first tokens) of an `Extend`."""
        for window, (first, slots) in ext.windows.items():
            self.offer.windows[window].slots[first : first + len(slots)] = slots
        self.ready = ext.ready if ext.ready is not None else self.ready
        if ext.final:
            self.final, self.first_tokens, self.cached_tokens = True, ext.first_tokens, ext.cached_tokens

    def range_slots(self, r: WindowRange) -> list[int]:
        return self.offer.windows[r.window].slots[r.first : r.first + r.count]

    def range_problem(self, ranges: list[WindowRange]) -> str | None:
        """A sentence when some range asks for blocks this lease does not hold."""
        for r in ranges:
            window = self.offer.windows.get(r.window)
            if window is None:
                return f"window {r.window} is not part of the lease"
            slots = window.slots
            if r.first < 0 or r.count < 0 or r.first + r.count > len(slots):
                return f"window {r.window}: blocks [{r.first}, {r.first + r.count}) outside the lease's " \
                       f"{len(slots)} blocks"
            if any(s == RELEASED for s in slots[r.first : r.first + r.count]):
                return f"window {r.window}: some blocks in [{r.first}, {r.first + r.count}) left the " \
                       f"sliding window and were released"
        return None
