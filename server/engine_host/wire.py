"""The engine loop's messages (server/engine_host/loop.py) and the engine link's sealing. The engine
thread hands them over in memory; the engine process sends them over ipc:// (link.py), each signed
(`link_codec`) under a key derived from a per-server secret and the direction, so a message of one
pipe is never valid on the other; one that fails the MAC or does not decode is dropped and counted.
Nothing is unpickled. HTTP -> engine: commands applied between steps; engine -> HTTP: `Ready` (or
`LoadFailed`), then one `StepOut` per step that has anything to say."""

from __future__ import annotations

from typing import Any

import msgspec

from server.telemetry.relay import EngineFigures, MetricsDelta
from server.types import GenerateRequest, LinkState, RequestOutput
from transceiver.signed import SignedCodec

TO_ENGINE, FROM_ENGINE = "to_engine", "from_engine"  # the two directions, and the names of their pipes
KEY_BYTES = 32  # of the per-server secret

# ---- HTTP -> engine

class Add(msgspec.Struct, tag=True, frozen=True):
    """Queue a request (its outputs stream back under its request_id)."""

    request: GenerateRequest


class Abort(msgspec.Struct, tag=True, frozen=True):
    """End a request (every choice) now and free its blocks (no-op if it ended already)."""

    request_id: str


class Release(msgspec.Struct, tag=True, frozen=True):
    """Context side: drop a lease whose generation leg will never pull (no-op if unknown)."""

    ctx_request_id: str


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


def link_codec(secret: bytes, *, engine_side: bool) -> SignedCodec:
    """One end of the engine link: the engine process's (`engine_side`) or the HTTP process's."""
    sends, receives = (FROM_ENGINE, TO_ENGINE) if engine_side else (TO_ENGINE, FROM_ENGINE)
    return SignedCodec(secret, "engine-link", sends, receives, ToEngine if engine_side else FromEngine)
