"""The engine on a thread of the HTTP process: `AsyncEngine`, the engine's front over two queues.
The engine thread owns the KV manager, the model and every tensor; HTTP stays responsive while the
model runs because its messages reach the event loop in batches (`_Queues`)."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from contextlib import suppress

from server.engine.core import EngineCore
from server.engine.health import HealthCheck
from server.engine_host.front import EngineFront
from server.engine_host.loop import run_engine
from server.engine_host.wire import FromEngine, Shutdown, ToEngine
from server.telemetry.kv_events import KvEventPublisher, KvEventSource
from server.telemetry.metrics import ServerMetrics

log = logging.getLogger(__name__)


class _Queues:
    """The engine thread's port: commands from a queue (None: only wake up); its messages are handed to
    the event loop in batches, waking it only if no wake-up is pending (order kept)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, handle: Callable[[FromEngine], None]) -> None:
        self.inbox: queue.SimpleQueue[ToEngine | None] = queue.SimpleQueue()
        self._loop, self._handle = loop, handle
        self._handed: list[FromEngine] = []
        self._lock = threading.Lock()

    def wake(self) -> None:
        self.inbox.put(None)

    def receive(self, timeout_s: float) -> list[ToEngine]:
        try:
            commands = [self.inbox.get(timeout=timeout_s) if timeout_s > 0 else self.inbox.get_nowait()]
        except queue.Empty:
            return []
        while True:
            try:
                commands.append(self.inbox.get_nowait())
            except queue.Empty:
                return [c for c in commands if c is not None]

    def send(self, message: FromEngine) -> None:
        with self._lock:
            wake = not self._handed  # else the wake-up scheduled for those is still to run
            self._handed.append(message)
        if wake:
            with suppress(RuntimeError):  # the event loop is closed: nobody reads any more
                self._loop.call_soon_threadsafe(self._hand_over)

    def _hand_over(self) -> None:
        with self._lock:
            messages, self._handed = self._handed, []
        for message in messages:
            self._handle(message)


class AsyncEngine(EngineFront):
    """`build_core` runs on the engine thread; until `Ready`, `is_ready()` is False (503)."""

    def __init__(self, build_core: Callable[[], EngineCore], model_name: str, max_seq_len: int, *,
                 metrics: ServerMetrics | None = None, publisher: KvEventPublisher | None = None,
                 epoch: str = "") -> None:
        super().__init__(model_name, max_seq_len, metrics)
        self._build_core = build_core
        self.core: EngineCore | None = None
        self.health = HealthCheck()  # its KV invariants, checked on the engine thread between steps
        self._kv_events = KvEventSource(publisher, epoch)
        self._port: _Queues | None = None
        self._thread: threading.Thread | None = None

    @property
    def tokenizer(self):
        return self.core.tokenizer

    def is_ready(self) -> bool:
        return self.info is not None and self._thread is not None and self._thread.is_alive()

    def wake(self) -> None:
        """Any thread: end the engine thread's idle wait now (e.g. a KV transfer message arrived)."""
        if self._port is not None:
            self._port.wake()

    # ---- lifecycle
    def start(self) -> None:
        self._port = _Queues(asyncio.get_running_loop(), self._handle)
        self._thread = threading.Thread(target=self._run, name="pdserve-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop; the engine thread closes the transceiver, the KV manager and the ranks."""
        if self._thread is not None:
            self._port.inbox.put(Shutdown())
            self._thread.join(timeout)

    async def stop(self) -> None:
        await asyncio.to_thread(self.shutdown)

    # ---- the engine thread
    def _send(self, message: ToEngine) -> bool:
        if self._thread is None or not self._thread.is_alive():
            return False
        self._port.inbox.put(message)
        return True

    def _run(self) -> None:
        run_engine(self._port, self._build, self._kv_events, health=self.health)

    def _build(self) -> EngineCore:
        self.core = self._build_core()
        return self.core
