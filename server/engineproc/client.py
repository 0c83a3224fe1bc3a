"""The HTTP process's engine when the engine runs in its own process (`engine_process`).

`EngineProcess` has the interface the routes use (`server.types.EngineServer`, like `AsyncEngine`):
requests go to the child as commands, and one reader task on the event loop takes the child's
messages and dispatches their outputs to per-request streams (server/engine/streams.py: outputs a
slow consumer has not read yet are coalesced per choice). What the routes read between requests
(/health, drain, /metrics) comes from the last `EngineState` the child sent. The tokenizer is
loaded here too, from the model directory the child's `Ready` names.

If the child dies, every request in flight ends with a 503 error output, and `on_fatal()` makes the
server exit non-zero (the launcher's supervisor restarts the whole server). Before `Ready`, its
death (or `LoadFailed`) is a `load_error`, which ends the server the same way (serve.py's watcher).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import secrets
from collections.abc import AsyncIterator, Callable, Iterable

from server.config.schema import ServerConfig
from server.deploy.supervisor import exit_text
from server.engine.commands import Abort, Add, Release
from server.engine.streams import ChoiceStream
from server.engineproc.link import HttpEnd, private_dir
from server.engineproc.spawn import Launch, start_engine_process, stop_engine_process
from server.engineproc.wire import (
    KEY_BYTES,
    EngineInfo,
    EngineState,
    LoadFailed,
    Probe,
    Ready,
    Shutdown,
    Snapshot,
    SnapshotReply,
    StepOut,
)
from server.telemetry.kv_events import SNAPSHOT_TIMEOUT_S
from server.telemetry.relay import RelayedMetrics
from server.types import GenerateRequest, LinkState, RequestOutput

log = logging.getLogger(__name__)

POLL_S = 0.2  # the reader looks at the child's exit status when nothing arrived for this long
STOP_TIMEOUT_S = 10.0


class EngineProcess:
    def __init__(self, cfg: ServerConfig, model_name: str, relay: RelayedMetrics, epoch: str,
                 on_fatal: Callable[[], None] | None = None) -> None:
        self.model_name = model_name
        self.max_seq_len = cfg.max_seq_len
        self.load_error: BaseException | None = None
        self.exit_code: int | None = None  # set once the child ended
        self.info: EngineInfo | None = None
        self._cfg, self._relay, self._epoch, self._on_fatal = cfg, relay, epoch, on_fatal
        self._tokenizer = None
        self._state = EngineState()
        self._streams: dict[str, ChoiceStream] = {}
        self._calls: dict[int, asyncio.Future[SnapshotReply]] = {}
        self._call_ids = itertools.count(1)
        self._end: HttpEnd | None = None
        self._proc = None
        self._tasks: list[asyncio.Task] = []
        self._stopping = False

    # ---- lifecycle (event loop thread: the main thread)
    def start(self) -> None:
        secret = secrets.token_bytes(KEY_BYTES)
        directory = private_dir()
        self._end = HttpEnd(directory, secret)
        self._proc = start_engine_process(Launch(self._cfg, str(directory), secret.hex(), self._epoch, os.getpid()))
        log.info("engine process %d started", self._proc.pid)
        reader = asyncio.create_task(self._read())
        reader.add_done_callback(self._reader_ended)
        self._tasks.append(reader)

    async def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Shutdown, wait at most `timeout_s`, then SIGKILL; requests still open end with an error."""
        self._stopping = True
        if self._proc is not None and self.exit_code is None:
            # still loading (no Ready): it reads no Shutdown before its model is up, and holds nothing yet
            graceful = self.info is not None and self._end.send(Shutdown())
            self.exit_code = await asyncio.to_thread(stop_engine_process, self._proc, timeout_s if graceful else 0.0)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._end_all("the server is shutting down")
        if self._end is not None:
            self._end.close()

    # ---- EngineClient
    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size

    def is_ready(self) -> bool:
        return self._tokenizer is not None and self.exit_code is None and not self._stopping

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        rid = request.request_id
        stream = ChoiceStream(rid, request.sampling.n)
        self._streams[rid] = stream
        if not self._send(Add(request)):
            stream.fail("the engine process is not running")
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

    # ---- EngineServer: what the routes read besides requests (the child's last state)
    def release_lease(self, ctx_request_id: str) -> None:
        self._send(Release(ctx_request_id))

    def health_problem(self) -> str | None:
        return self._state.health_problem

    def links(self) -> LinkState:
        return self._state.links

    def idle(self) -> bool:
        return self.exit_code is not None or self._state.idle

    def probe(self, endpoints: Iterable[str]) -> None:
        self._send(Probe(sorted(endpoints)))

    async def snapshot(self) -> dict:
        """The reuse cache's snapshot (GET /kv_cache/hashes); TimeoutError after SNAPSHOT_TIMEOUT_S."""
        call_id = next(self._call_ids)
        answer: asyncio.Future[SnapshotReply] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = answer
        try:
            if not self._send(Snapshot(call_id)):
                raise ConnectionError("the engine process is not running")
            reply = await asyncio.wait_for(answer, SNAPSHOT_TIMEOUT_S)
        finally:
            self._calls.pop(call_id, None)
        if reply.error is not None:
            raise RuntimeError(f"the engine's cache snapshot failed: {reply.error}")
        return reply.snapshot

    # ---- the reader
    def _send(self, message) -> bool:
        return self._end is not None and self.exit_code is None and self._end.send(message)

    async def _read(self) -> None:
        while True:
            messages = await self._end.receive(POLL_S)
            for message in messages:
                self._handle(message)
            if not messages and self._proc.poll() is not None:
                self._died(self._proc.returncode)
                return
            await asyncio.sleep(0)  # the streams' writers run between batches, however fast they come

    def _reader_ended(self, task: asyncio.Task) -> None:
        """A reader that broke (a bug) would leave every request waiting: the server exits instead."""
        if task.cancelled() or task.exception() is None:
            return
        log.error("the engine link's reader failed", exc_info=task.exception())
        self._stopping = True
        self._end_all("the server lost its engine (internal error); it is restarting", 500)
        if self._on_fatal is not None:
            self._on_fatal()

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
            self._tasks.append(asyncio.create_task(self._load_tokenizer(message.info)))
        elif isinstance(message, LoadFailed):
            self.load_error = RuntimeError(message.error)

    def _set_state(self, state: EngineState) -> None:
        self._state = state
        self._relay.update(state.figures)

    async def _load_tokenizer(self, info: EngineInfo) -> None:
        from transformers import AutoTokenizer

        try:
            self._tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, info.model_dir)
        except Exception as exc:
            log.exception("the tokenizer of %s could not load", info.model_dir)
            self.load_error = exc
            return
        log.info("engine process %d ready", info.pid)

    def _died(self, returncode: int) -> None:
        self.exit_code = returncode
        if self._stopping:
            return
        reason = f"the engine process exited with {exit_text(returncode)}"
        if self._tokenizer is None:  # not ready yet: a load failure (serve.py's watcher ends the server)
            self.load_error = self.load_error or RuntimeError(f"{reason} before it was ready (its log says why)")
            return
        log.error("%s: failing %d requests in flight; the server exits", reason, len(self._streams))
        self._end_all(f"{reason}; this server is restarting", 503)
        for answer in self._calls.values():
            if not answer.done():
                answer.set_exception(ConnectionError(reason))
        if self._on_fatal is not None:
            self._on_fatal()

    def _end_all(self, message: str, code: int = 503) -> None:
        for stream in self._streams.values():
            stream.fail(message, code)


class RemoteKvEvents:
    """`app.state.kv_events` of a server whose engine runs in its own process (the publisher runs
    there; GET /kv_cache/events and /kv_cache/hashes read it through the engine link)."""

    class Published:
        def __init__(self, endpoint: str) -> None:
            self.endpoint = endpoint

    def __init__(self, engine: EngineProcess, epoch: str) -> None:
        self._engine = engine
        self.epoch = epoch

    @property
    def publisher(self) -> Published | None:
        info = self._engine.info
        endpoint = info.kv_events_endpoint if info is not None else None
        return self.Published(endpoint) if endpoint is not None else None

    async def snapshot(self) -> dict:
        return await self._engine.snapshot()
