"""The engine loop of both hosts (a thread of the HTTP process, or the engine process): receive
commands -> step -> KV events tick -> KV health check -> deliver one `StepOut`. Commands and messages go
through a `Port` (queues for the thread, the ipc link for the process), so the HTTP side (front.py)
reads the same messages from either."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from server.engine.core import EngineCore
from server.engine.health import HealthCheck
from server.engine_host.wire import (
    Abort,
    Add,
    EngineInfo,
    EngineState,
    FromEngine,
    LoadFailed,
    Probe,
    Ready,
    Release,
    Shutdown,
    Snapshot,
    SnapshotReply,
    StepOut,
    ToEngine,
)
from server.telemetry.kv_events import KvEventSource
from server.telemetry.relay import MetricsRecorder, engine_figures
from server.types import LinkState, RequestOutput

log = logging.getLogger(__name__)

STATE_INTERVAL_S = 0.1  # an idle engine's state (health, handshakes, leases) goes out at most this often


class Port(Protocol):
    def receive(self, timeout_s: float) -> list[ToEngine]:
        """The commands that came, after waiting at most `timeout_s` for one (or a wake-up)."""
        ...

    def send(self, message: FromEngine) -> None: ...

    def wake(self) -> None:
        """Any thread: end a `receive` wait now."""
        ...


class EngineLoop:
    def __init__(self, core: EngineCore, port: Port, kv_events: KvEventSource, health: HealthCheck) -> None:
        self.core, self.port, self.kv_events, self.health = core, port, kv_events, health
        self.recorder = MetricsRecorder()
        core.timings.metrics = self.recorder
        self.recorder.watch_transfers(core)
        kv_events.attach(core.kv)
        self.stopped = False
        self._outputs: list[RequestOutput] = []  # the commands' outputs, sent with the next step's
        self._replies: list[SnapshotReply] = []  # filled by snapshot futures during the KV events hook
        self._sent_state: EngineState | None = None
        self._state_at = 0.0

    def state(self) -> EngineState:
        core = self.core
        return EngineState(idle=idle_of(core), health_problem=self.health.problem, links=links_of(core),
                           figures=engine_figures(core))

    def ready(self) -> Ready:
        publisher, spec = self.kv_events.publisher, self.core.runner.spec
        info = EngineInfo(model_dir=str(spec.model_dir), vocab_size=spec.vocab_size, pid=os.getpid(),
                          kv_events_endpoint=publisher.endpoint if publisher is not None else None)
        return Ready(info, self.state())

    def run(self, alive: Callable[[], bool] = lambda: True) -> None:
        while not self.stopped and alive():
            for message in self.port.receive(self.core.idle_wait_s()):
                self._handle(message)
            if self.stopped:
                break
            outputs = self._outputs + self._step()
            self._outputs = []
            self.kv_events.on_tick(self.core)
            self.health.maybe_check(self.core)
            self._deliver(outputs)

    def close(self) -> None:
        """After the loop: fail the transceiver's transfers and close its sockets, close the publisher,
        let the disk tier's queued writes land, stop a tensor-parallel engine's other ranks."""
        for link in transceiver(self.core):
            if link is not None:
                link.close()
        if self.kv_events.publisher is not None:
            self.kv_events.publisher.close()
        self.core.kv.close()
        ranks = getattr(self.core.runner, "ranks", None)
        if ranks is not None:
            ranks.stop()

    def _step(self) -> list[RequestOutput]:
        """One engine step; a broken step fails what was in flight instead of killing the loop."""
        try:
            return self.core.step()
        except Exception as exc:
            log.exception("engine step failed")
            return [o for r in self.core.scheduler.live() for o in self.core.fail(r, f"engine error: {exc}", code=500)]

    def _handle(self, message: ToEngine) -> None:
        """A refused add or an abort ends its request at once: its outputs go with the next step's."""
        if isinstance(message, Add):
            self._outputs += self.core.add_request(message.request)
        elif isinstance(message, Abort):
            self._outputs += self.core.abort(message.request_id)
        elif isinstance(message, Release):
            self.core.connector.drop_lease(message.ctx_request_id)
        elif isinstance(message, Probe):
            probe(self.core, message.endpoints)
        elif isinstance(message, Snapshot):
            self.kv_events.request_snapshot().add_done_callback(self._answer(message.call_id))
        elif isinstance(message, Shutdown):
            self.stopped = True

    def _answer(self, call_id: int) -> Callable:
        def done(future) -> None:  # on this thread, in the KV events hook
            error = future.exception()
            reply = SnapshotReply(call_id, error=f"{type(error).__name__}: {error}") if error is not None \
                else SnapshotReply(call_id, snapshot=future.result())
            self._replies.append(reply)
        return done

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        replies, self._replies = self._replies, []
        for reply in replies:
            self.port.send(reply)
        state = self._changed_state()
        metrics = self.recorder.take()
        if outputs or metrics is not None or state is not None:
            self.port.send(StepOut(outputs, metrics, state))

    def _changed_state(self) -> EngineState | None:
        """The state after a productive step, else at most every STATE_INTERVAL_S; None if unchanged."""
        now = time.monotonic()
        if not self.core.did_work and now - self._state_at < STATE_INTERVAL_S:
            return None
        self._state_at = now
        state = self.state()
        if state == self._sent_state:
            return None
        self._sent_state = state
        return state


def transceiver(core: Any) -> tuple[Any, Any]:
    """(KVSender or None, KVReceiver or None) of an engine core."""
    role = getattr(core, "connector", None)
    return getattr(role, "sender", None), getattr(role, "receiver", None)


def links_of(core: Any) -> LinkState:
    sender, receiver = transceiver(core)
    dead = tuple(link.link_name for link in (sender, receiver) if link is not None and not link.link_alive)
    return LinkState(dead=dead, peers=receiver.peer_status() if receiver is not None else None,
                     sender=(sender.endpoint, sender.epoch) if sender is not None else None,
                     sender_endpoints=tuple(getattr(sender, "endpoints", ())))


def idle_of(core: EngineCore) -> bool:
    """No request queued or running, no KV lease or pull."""
    sender, receiver = transceiver(core)
    return not core.scheduler.has_work() and (sender is None or sender.num_leases == 0) \
        and (receiver is None or receiver.num_pulls == 0)


def probe(core: Any, endpoints: Iterable[str]) -> None:
    """Generation side: shake hands with every KV sender in `endpoints` (the layouts must agree)."""
    receiver = transceiver(core)[1]
    if receiver is None or not receiver.link_alive:
        return
    for endpoint in endpoints:
        try:
            receiver.probe(endpoint)
        except RuntimeError as exc:  # the socket thread stopped or is swamped: /health says so
            log.warning("could not probe %s: %s", endpoint, exc)


def run_engine(port: Port, build: Callable[[], EngineCore], kv_events: KvEventSource, *,
               health: HealthCheck | None = None, alive: Callable[[], bool] = lambda: True) -> EngineLoop | None:
    """A host's engine from start to end: the KV event publisher, the core (`build`), `Ready` or
    `LoadFailed`, the loop until `Shutdown` (or `alive()` turns False), close. None: it did not load."""
    kv_events.wake = port.wake
    try:
        if kv_events.publisher is not None:
            kv_events.publisher.start()
        loop = EngineLoop(build(), port, kv_events, health or HealthCheck())
    except BaseException as exc:
        log.exception("engine failed to load")
        if kv_events.publisher is not None:
            kv_events.publisher.close()
        port.send(LoadFailed(f"{type(exc).__name__}: {exc}"))
        return None
    port.send(loop.ready())
    try:
        loop.run(alive)
    finally:
        loop.close()
    return loop
