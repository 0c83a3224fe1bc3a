"""What the generation side's engine and socket threads trade: commands, then delivered items."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from transceiver.tp import Part
from transceiver.wire import Body, ChunkHeader, Done, Failed, IpcChunk, PullRequest


@dataclass(frozen=True)
class Pull:
    """Command: send `request` to `endpoint` once a handshake with `request.ctx_epoch` is done."""

    endpoint: str
    request: PullRequest


@dataclass(frozen=True)
class Probe:
    """Command: shake hands with `endpoint` unless that is done or under way (no pull needed)."""

    endpoint: str


@dataclass(frozen=True)
class Send:
    """Command: send `body` to `endpoint` now (Ack, Cancel: no handshake needed)."""

    endpoint: str
    body: Body


@dataclass(frozen=True)
class Received:
    """A message from a context server for the engine thread (payload: a chunk's raw frames)."""

    endpoint: str
    sender_epoch: str
    body: ChunkHeader | IpcChunk | Done | Failed
    payload: list[zmq.Frame] = field(default_factory=list)
    at: float = field(default_factory=time.monotonic)  # when the socket thread received it


@dataclass(frozen=True)
class IpcPools:
    """The sender's primary pools of `epoch` at `endpoint` opened through CUDA IPC (window -> view on
    our device); None: forget that endpoint's pools."""

    endpoint: str
    epoch: str | None
    pools: dict[int, Any] | None


@dataclass(frozen=True)
class Planned:
    """The pull goes out as these parts (the first keeps its id); the lease ends with a `Release`."""

    pull_id: int
    parts: list[tuple[int, Part]]  # (pull id, what it brings)
    ctx_request_id: str
    ctx_epoch: str


@dataclass(frozen=True)
class PullRefused:
    """The pull was never sent: handshake refused or the peer's epoch is not the pull's."""

    pull_id: int
    reason: str
    detail: str


@dataclass(frozen=True)
class PeerDown:
    """The connection to `endpoint` was lost: pulls sent there will get no answer."""

    endpoint: str
    detail: str
