"""The sender's bookkeeping of one leased context request: its pinned blocks and the pull serving them."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import zmq

from transceiver.messages import WindowRange
from transceiver.payload import ChunkPlan


@dataclass
class Job:
    """One pull being served: chunks left to send, then Done, then waiting for the Ack."""

    peer: bytes  # ROUTER identity of the receiver
    pull_id: int
    chunks: deque[ChunkPlan]
    started: float  # monotonic
    sent_bytes: int = 0
    sent_chunks: int = 0
    done_sent: bool = False  # an Ack now ends the lease


@dataclass
class Lease:
    blocks: dict[int, list[int]]  # window -> block ids of the prompt, -1 = released (out of window)
    num_tokens: int
    deadline: float  # monotonic
    job: Job | None = None
    pinned: dict[int, list[int]] = field(default_factory=dict)
    pool_frames: list[zmq.MessageTracker] = field(default_factory=list)  # zero-copy frames of its slots

    def range_ids(self, r: WindowRange) -> list[int]:
        return self.blocks[r.window][r.first : r.first + r.count]

    def range_problem(self, ranges: list[WindowRange]) -> str | None:
        """A sentence when some range asks for blocks this lease does not hold."""
        for r in ranges:
            ids = self.blocks.get(r.window)
            if ids is None:
                return f"window {r.window} is not part of the lease"
            if r.first < 0 or r.count < 0 or r.first + r.count > len(ids):
                return f"window {r.window}: blocks [{r.first}, {r.first + r.count}) outside the lease's " \
                       f"{len(ids)} blocks"
            if any(b < 0 for b in ids[r.first : r.first + r.count]):
                return f"window {r.window}: some blocks in [{r.first}, {r.first + r.count}) left the " \
                       f"sliding window and were released"
        return None
