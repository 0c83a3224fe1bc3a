"""The link between a server's HTTP process and its engine process: the messages and their sealing.

Two ZeroMQ PUSH/PULL pipes over ipc:// sockets in a private 0700 directory the HTTP process made
(server/engineproc/link.py). Each message is `[payload, mac]`: msgpack of one tagged Struct below,
and HMAC-SHA256 of it under a key derived from a random per-server secret (handed to the child on
its stdin, never on argv) and the direction, so a message of one pipe is never valid on the other.
A message that fails the MAC or does not decode into a message of its direction raises `Rejected`
and is dropped (and counted) by the reader. Nothing is ever unpickled.

HTTP -> engine: the engine commands (server/engine/commands.py: Add, Abort, Release), `Probe`,
`Snapshot` (an RPC answered by `SnapshotReply`) and `Shutdown`.
engine -> HTTP: `Ready` once loaded (or `LoadFailed`), then ONE `StepOut` per step of the engine
loop that has anything to say: the step's outputs, what the metrics observed, and the engine's
state when it changed (at most every STATE_INTERVAL_S while idle, after every productive step).
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

import msgspec

from server.engine.commands import Abort, Add, Release
from server.telemetry.relay import EngineFigures, MetricsDelta
from server.types import LinkState, RequestOutput

TO_ENGINE = b"pdserve engine link v1: http -> engine"
FROM_ENGINE = b"pdserve engine link v1: engine -> http"
KEY_BYTES = 32


class Rejected(Exception):
    """A message that is not ours: wrong frame count, bad MAC, or not a message of this direction."""


# ---- HTTP -> engine (besides the engine commands)

class Probe(msgspec.Struct, tag=True, frozen=True):
    """Generation side: shake hands with these KV senders (the context directory's endpoints)."""

    endpoints: list[str]


class Snapshot(msgspec.Struct, tag=True, frozen=True):
    """Ask for the reuse cache's snapshot (GET /kv_cache/hashes); answered by `SnapshotReply`."""

    call_id: int


class Shutdown(msgspec.Struct, tag=True, frozen=True):
    """Stop the loop, close the transceiver and the KV event publisher, exit 0."""


ToEngine = Add | Abort | Release | Probe | Snapshot | Shutdown


# ---- engine -> HTTP

class EngineState(msgspec.Struct, frozen=True):
    """What the HTTP process reads between steps: /health, drain, /metrics' scrape-time figures."""

    idle: bool = True  # no request queued or running, no KV lease or pull
    health_problem: str | None = None  # the engine's KV invariants (server/engine/health.py)
    links: LinkState = LinkState()
    figures: EngineFigures = EngineFigures()


class EngineInfo(msgspec.Struct, frozen=True):
    model_dir: str  # the HTTP process loads the same tokenizer from it
    vocab_size: int
    pid: int
    kv_events_endpoint: str | None  # where the KV event publisher listens (None: no deployment token)


class Ready(msgspec.Struct, tag=True, frozen=True):
    info: EngineInfo
    state: EngineState


class LoadFailed(msgspec.Struct, tag=True, frozen=True):
    error: str


class StepOut(msgspec.Struct, tag=True, frozen=True):
    outputs: list[RequestOutput]
    metrics: MetricsDelta | None = None
    state: EngineState | None = None  # None: unchanged since the last one sent


class SnapshotReply(msgspec.Struct, tag=True, frozen=True):
    call_id: int
    snapshot: dict[str, Any] | None = None
    error: str | None = None


FromEngine = Ready | LoadFailed | StepOut | SnapshotReply


class LinkCodec:
    """Seals what one side sends and opens what it receives (one instance per side)."""

    def __init__(self, secret: bytes, *, engine_side: bool) -> None:
        if len(secret) < KEY_BYTES:
            raise ValueError(f"the engine link's secret must have at least {KEY_BYTES} bytes")
        to_engine = hmac.new(secret, TO_ENGINE, hashlib.sha256).digest()
        from_engine = hmac.new(secret, FROM_ENGINE, hashlib.sha256).digest()
        self._send_key, self._open_key = (from_engine, to_engine) if engine_side else (to_engine, from_engine)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(ToEngine if engine_side else FromEngine)

    def seal(self, message: msgspec.Struct) -> list[bytes]:
        payload = self._encoder.encode(message)
        return [payload, hmac.new(self._send_key, payload, hashlib.sha256).digest()]

    def open(self, frames: list[bytes]) -> Any:
        if len(frames) != 2:
            raise Rejected(f"{len(frames)} frames, not 2")
        payload, mac = frames
        if not hmac.compare_digest(hmac.new(self._open_key, payload, hashlib.sha256).digest(), mac):
            raise Rejected("bad MAC")
        try:
            return self._decoder.decode(payload)
        except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
            raise Rejected(f"undecodable: {exc}") from None
