"""A pull as the generation side's engine thread tracks it: the request (`Pulling`), its parts (one
per context rank: whole slots without tensor parallelism, else some kv heads of every block), its
`PullResult`, and `check_wanted`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvcache import KVCacheManager, Level
from transceiver.tp import Heads
from transceiver.wire import Done

Wanted = dict[int, tuple[int, list[int]]]  # window -> (first block index, destination slots)


@dataclass(frozen=True)
class PullResult:
    request_id: str
    ok: bool
    reason: str | None = None  # one of wire.REASONS when not ok
    error: str | None = None  # a sentence for the client when not ok
    nbytes: int = 0
    seconds: float = 0.0
    first_tokens: tuple[int, ...] = ()  # a streamed pull: the context server's first token(s)
    cached_tokens: int = 0  # a streamed pull: the context server's prefix hit


@dataclass
class Pulling:
    """One request's pull (the caller's unit: one `PullResult`)."""

    request_id: str
    pull_id: int  # its first part's id; also the id the link plans it under
    endpoint: str  # the context server's (its rank 0's)
    ctx_epoch: str
    ctx_request_id: str
    wanted: Wanted
    started: float  # monotonic
    deadline: float
    parts: dict[int, Part] = field(default_factory=dict)  # running parts by pull_id (empty until planned)
    done_parts: list[Part] = field(default_factory=list)
    several: bool = False  # several ranks on a side: the lease ends with Release, not with an Ack
    stream: bool = False  # pulled while the context server prefills (transceiver/sender/stream.py)
    first_tokens: tuple[int, ...] = ()  # from a streamed pull's Done
    cached_tokens: int = 0

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in [*self.parts.values(), *self.done_parts])


@dataclass
class Part:
    """What one context rank sends of the request: every block of `wanted`, whole or some heads."""

    pulling: Pulling
    pull_id: int
    endpoint: str
    dst: Heads | None  # our kv heads the sender's go into (None: whole slots)
    next_first: dict[int, int] = field(default_factory=dict)  # window -> next block index expected
    nbytes: int = 0
    chunks: int = 0
    via_ipc: bool = False  # chunks came as CUDA IPC copies
    first_at: float | None = None  # when the socket thread received its first answer
    apply_s: float = 0.0  # checking and writing chunks (IPC: from queueing each copy until it is checked)
    done: Done | None = None  # arrived while its IPC copies were still on the device

    def __post_init__(self) -> None:
        self.next_first = {w: first for w, (first, _) in self.pulling.wanted.items()}

    def missing(self) -> list[int]:
        return [w for w, (first, slots) in self.pulling.wanted.items() if self.next_first[w] != first + len(slots)]


def check_wanted(kv: KVCacheManager, wanted: Wanted) -> None:
    """ValueError unless every window is known and every destination slot is in its primary pool."""
    for window, (first, slots) in wanted.items():
        if window not in kv.window_sizes:
            raise ValueError(f"unknown window {window}; valid: {sorted(kv.window_sizes)}")
        num_slots = kv.pool(window, Level.PRIMARY).shape[0]
        if first < 0 or any(not 0 <= s < num_slots for s in slots):
            raise ValueError(f"window {window}: bad first block {first} "
                             f"or slots outside [0, {num_slots})")
