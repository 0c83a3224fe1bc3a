"""The HTTP process's side of its engine, whichever host runs the engine loop: `AsyncEngine` and
`EngineProcess` are this class with their own transport (`_send`; messages come back to `_handle`).

A `StepOut`'s outputs go to per-request streams, its metrics into the server's registry, and its
state is kept for /health, the drain and /metrics."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Iterable

from server.engine_host.streams import ChoiceStream
from server.engine_host.wire import (
    Abort,
    Add,
    EngineInfo,
    EngineState,
    LoadFailed,
    Probe,
    Ready,
    Release,
    Snapshot,
    SnapshotReply,
    StepOut,
    ToEngine,
)
from server.telemetry.kv_events import SNAPSHOT_TIMEOUT_S
from server.telemetry.metrics import ServerMetrics
from server.telemetry.relay import RelayedMetrics
from server.types import GenerateRequest, LinkState, RequestOutput


class EngineFront:
    def __init__(self, model_name: str, max_seq_len: int, metrics: ServerMetrics | None) -> None:
        self.model_name = model_name
        self.max_seq_len = max_seq_len
        self.load_error: BaseException | None = None  # the engine could not start (the process exits)
        self.info: EngineInfo | None = None  # from the loop's Ready
        self._relay = RelayedMetrics(metrics if metrics is not None else ServerMetrics())
        self._state = EngineState()
        self._streams: dict[str, ChoiceStream] = {}
        self._calls: dict[int, asyncio.Future[SnapshotReply]] = {}
        self._call_ids = itertools.count(1)

    def _send(self, message: ToEngine) -> bool:
        """Hand a command to the engine loop (event loop thread); False when it is not running."""
        raise NotImplementedError

    def _on_ready(self, info: EngineInfo) -> None:
        """What the host does once its engine loaded (e.g. load the tokenizer)."""

    # ---- EngineClient
    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        rid = request.request_id
        stream = ChoiceStream(rid, request.sampling.n)
        self._streams[rid] = stream
        if not self._send(Add(request)):
            stream.fail("the engine is not running")
        try:
            while not stream.done:  # until every choice's final output
                for output in await stream.take():
                    yield output
        finally:
            self._streams.pop(rid, None)
            if not stream.done:
                self._send(Abort(rid))

    async def abort(self, request_id: str) -> None:
        self._send(Abort(request_id))

    # ---- what one server's routes and its drain read besides requests (the loop's last state)
    def release_lease(self, ctx_request_id: str) -> None:
        """Context side: drop a lease whose generation leg will never pull (no-op if unknown)."""
        self._send(Release(ctx_request_id))

    def health_problem(self) -> str | None:
        """None while the engine's KV invariants hold; else a sentence naming the broken check."""
        return self._state.health_problem

    def links(self) -> LinkState:
        return self._state.links

    def idle(self) -> bool:
        """Nothing left to finish: no request queued or running, no KV lease or pull."""
        return self._state.idle

    def probe(self, endpoints: Iterable[str]) -> None:
        """Generation side: shake hands with these KV senders now (best effort, never blocks)."""
        self._send(Probe(sorted(endpoints)))

    async def snapshot(self) -> dict:
        """The reuse cache's snapshot (GET /kv_cache/hashes); TimeoutError after SNAPSHOT_TIMEOUT_S."""
        call_id = next(self._call_ids)
        answer: asyncio.Future[SnapshotReply] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = answer
        try:
            if not self._send(Snapshot(call_id)):
                raise ConnectionError("the engine is not running")
            reply = await asyncio.wait_for(answer, SNAPSHOT_TIMEOUT_S)
        finally:
            self._calls.pop(call_id, None)
        if reply.error is not None:
            raise RuntimeError(f"the engine's cache snapshot failed: {reply.error}")
        return reply.snapshot

    # ---- the loop's messages (event loop thread)
    def _handle(self, message) -> None:
        if isinstance(message, StepOut):
            if message.metrics is not None:
                self._relay.replay(message.metrics)
            if message.state is not None:
                self._set_state(message.state)
            for output in message.outputs:
                stream = self._streams.get(output.request_id)
                if stream is not None:
                    stream.put(output)
        elif isinstance(message, SnapshotReply):
            answer = self._calls.get(message.call_id)
            if answer is not None and not answer.done():
                answer.set_result(message)
        elif isinstance(message, Ready):
            self.info = message.info
            self._set_state(message.state)
            self._on_ready(message.info)
        elif isinstance(message, LoadFailed):
            self.load_error = RuntimeError(message.error)

    def _set_state(self, state: EngineState) -> None:
        self._state = state
        self._relay.update(state.figures)

    def _end_all(self, message: str, code: int = 503) -> None:
        for stream in self._streams.values():
            stream.fail(message, code)

