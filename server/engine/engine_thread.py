"""Runs an EngineCore in its own thread and exposes it to asyncio (the `EngineClient` contract).

The engine thread owns the KV manager, the model and every tensor. The event loop only enqueues
commands and receives outputs, so HTTP stays responsive while the model runs.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterable

from server.engine import status
from server.engine.commands import Abort, Add, Command, Release, apply, guarded_step
from server.engine.core import EngineCore
from server.engine.health import HealthCheck
from server.engine.streams import ChoiceStream
from server.types import GenerateRequest, LinkState, RequestOutput

log = logging.getLogger(__name__)


class AsyncEngine:
    """`build_core` runs on the engine thread (which then owns every tensor); until it returns,
    `is_ready()` is False and the HTTP layer answers 503."""

    def __init__(self, build_core: Callable[[], EngineCore], model_name: str, max_seq_len: int) -> None:
        self._build_core = build_core
        self.core: EngineCore | None = None
        self.load_error: BaseException | None = None
        self.model_name = model_name
        self.max_seq_len = max_seq_len
        self._inbox: queue.SimpleQueue[Command | None] = queue.SimpleQueue()  # None: only wake up
        self._streams: dict[str, ChoiceStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._on_tick: list[Callable[[EngineCore], None]] = []
        self.health = HealthCheck()  # its KV invariants, checked on the engine thread between steps
        # outputs waiting for the event loop; while it is non-empty a wake-up is pending (_hand_over)
        self._handed: list[RequestOutput] = []
        self._handed_lock = threading.Lock()

    @property
    def tokenizer(self):
        return self.core.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.core.runner.spec.vocab_size

    def is_ready(self) -> bool:
        return self.core is not None and self._thread is not None and self._thread.is_alive()

    def health_problem(self) -> str | None:
        """None while the engine's KV invariants hold; else a sentence naming the broken check."""
        return self.health.problem

    # read from the event loop's thread: plain reads of what the engine thread writes
    def links(self) -> LinkState:
        return status.links_of(self.core)

    def idle(self) -> bool:
        return status.idle_of(self.core)

    def probe(self, endpoints: Iterable[str]) -> None:
        status.probe(self.core, endpoints)

    def add_tick_hook(self, hook: Callable[[EngineCore], None]) -> None:
        """Run `hook(core)` on the engine thread after every tick (e.g. metrics snapshots)."""
        self._on_tick.append(hook)

    # ---- lifecycle
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="pdserve-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._inbox.put(None)
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- EngineClient
    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        stream = ChoiceStream(request.request_id, request.sampling.n)
        self._streams[request.request_id] = stream
        self._inbox.put(Add(request))
        try:
            while not stream.done:  # until every choice's final output
                for output in await stream.take():
                    yield output
        finally:
            self._streams.pop(request.request_id, None)
            if not stream.done:
                self._inbox.put(Abort(request.request_id))

    async def abort(self, request_id: str) -> None:
        self._inbox.put(Abort(request_id))

    def wake(self) -> None:
        """Any thread: end the engine thread's idle wait now (e.g. a KV transfer message arrived)."""
        self._inbox.put(None)

    def release_lease(self, ctx_request_id: str) -> None:
        """Context side: drop a lease whose generation leg will never pull (no-op if unknown)."""
        self._inbox.put(Release(ctx_request_id))

    # ---- engine thread
    def _run(self) -> None:
        try:
            self.core = self._build_core()
        except BaseException as exc:
            log.exception("engine failed to load")
            self.load_error = exc
            return
        while not self._stop.is_set():
            self._drain_inbox(self.core.idle_wait_s())
            outputs = guarded_step(self.core)  # a broken step fails what was in flight, not the server
            if outputs:
                self._hand_over(outputs)
            for hook in self._on_tick:
                hook(self.core)
            self.health.maybe_check(self.core)

    def _drain_inbox(self, wait_s: float) -> None:
        try:
            command = self._inbox.get(timeout=wait_s) if wait_s > 0 else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if command is not None:
                self._apply(command)
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _apply(self, command: Command) -> None:
        outputs = apply(self.core, command)  # a refused add or an abort ends its request at once
        if outputs:
            self._hand_over(outputs)

    def _hand_over(self, outputs: list[RequestOutput]) -> None:
        """Engine thread: queue outputs for the event loop, waking it only if no wake-up is pending.
        While the loop is busy (many streams), steps add to the same batch instead of each paying
        a self-pipe write and a GIL hand-off; the order of outputs is kept."""
        with self._handed_lock:
            wake = not self._handed  # else the wake-up scheduled for those is still to run
            self._handed.extend(outputs)
        if wake:
            self._loop.call_soon_threadsafe(self._deliver_handed)

    def _deliver_handed(self) -> None:
        with self._handed_lock:
            outputs, self._handed = self._handed, []
        for output in outputs:
            self._deliver(output)

    def _deliver(self, output: RequestOutput) -> None:
        stream = self._streams.get(output.request_id)
        if stream is not None:
            stream.put(output)
