"""A pull as the generation side's engine thread tracks it (`PullState`), what it reports when it ends
(`PullResult`), and the check of what a caller asks to pull into (`check_wanted`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvcache import KVCacheManager, Level
from transceiver.wire import Done


@dataclass(frozen=True)
class PullResult:
    request_id: str
    ok: bool
    reason: str | None = None  # one of wire.REASONS when not ok
    error: str | None = None  # a sentence for the client when not ok
    nbytes: int = 0
    seconds: float = 0.0


@dataclass
class PullState:
    request_id: str
    pull_id: int
    endpoint: str
    ctx_epoch: str
    ctx_request_id: str
    wanted: dict[int, tuple[int, list[int]]]  # window -> (first block index, destination slots)
    started: float  # monotonic
    deadline: float
    next_first: dict[int, int] = field(default_factory=dict)  # window -> next block index expected
    nbytes: int = 0
    chunks: int = 0
    via_ipc: bool = False  # chunks came as CUDA IPC copies
    first_at: float | None = None  # when the socket thread received the pull's first answer
    apply_s: float = 0.0  # checking and writing chunks (IPC: from queueing each copy until it is checked)
    done: Done | None = None  # arrived while copies were still on the device


def check_wanted(kv: KVCacheManager, wanted: dict[int, tuple[int, list[int]]]) -> None:
    """ValueError unless every window is known and every destination slot is in its primary pool."""
    for window, (first, slots) in wanted.items():
        if window not in kv.window_sizes:
            raise ValueError(f"unknown window {window}; valid: {sorted(kv.window_sizes)}")
        num_slots = kv.pool(window, Level.PRIMARY).shape[0]
        if first < 0 or any(not 0 <= s < num_slots for s in slots):
            raise ValueError(f"window {window}: bad first block {first} "
                             f"or slots outside [0, {num_slots})")
