"""The engine process's loop: what `AsyncEngine._run` does on its thread, with a socket for queues.

receive commands (waiting at most the core's idle wait) -> step -> tick hooks (metrics, KV events,
snapshots) -> KV health check -> send ONE `StepOut` with the step's outputs, the metrics observed
and the state if it changed. The loop owns the core and the engine end of the link; it ends on
`Shutdown`, or when the HTTP process that started it is gone (a backstop: the kernel's parent-death
signal usually ends this process first, server/engineproc/main.py).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

from server.engine import status
from server.engine.commands import Abort, Add, Release, apply, guarded_step
from server.engine.core import EngineCore
from server.engine.health import HealthCheck
from server.engineproc.link import EngineEnd
from server.engineproc.wire import EngineState, Probe, Shutdown, Snapshot, SnapshotReply, StepOut
from server.telemetry.bridge import TelemetryBridge
from server.telemetry.kv_events import KvEventSource
from server.telemetry.relay import MetricsRecorder
from server.types import RequestOutput

log = logging.getLogger(__name__)

STATE_INTERVAL_S = 0.1  # an idle engine's state (health, handshakes, leases) goes out at most this often
PARENT_CHECK_S = 1.0


class EngineHost:
    def __init__(self, core: EngineCore, end: EngineEnd, recorder: MetricsRecorder, bridge: TelemetryBridge,
                 kv_events: KvEventSource, parent_pid: int) -> None:
        self.core, self.end, self.recorder, self.bridge, self.kv_events = core, end, recorder, bridge, kv_events
        self.health = HealthCheck()
        self._parent_pid = parent_pid
        self._stop = False
        self._outputs: list[RequestOutput] = []  # the commands' outputs, sent with the next step's
        self._replies: list[SnapshotReply] = []  # filled by snapshot futures during the KV events hook
        self._sent_state: EngineState | None = None
        self._state_at = 0.0
        self._parent_at = 0.0

    def state(self) -> EngineState:
        core = self.core
        return EngineState(idle=status.idle_of(core), health_problem=self.health.problem,
                           links=status.links_of(core), figures=self.recorder.figures(self.bridge.kv_stats()))

    def run(self) -> None:
        while not self._stop and self._parent_alive():
            for message in self.end.receive(self.core.idle_wait_s()):
                self._handle(message)
            if self._stop:
                break
            outputs = self._outputs + guarded_step(self.core)
            self._outputs = []
            self.bridge.on_tick(self.core)
            self.kv_events.on_tick(self.core)
            self.health.maybe_check(self.core)
            self._send(outputs)

    def _handle(self, message) -> None:
        if isinstance(message, Add | Abort | Release):
            self._outputs += apply(self.core, message)  # a refused add or an abort ends its request at once
        elif isinstance(message, Probe):
            status.probe(self.core, message.endpoints)
        elif isinstance(message, Snapshot):
            self.kv_events.request_snapshot().add_done_callback(self._answer(message.call_id))
        elif isinstance(message, Shutdown):
            self._stop = True

    def _answer(self, call_id: int) -> Callable:
        def done(future) -> None:  # on this thread, in the KV events hook
            error = future.exception()
            reply = SnapshotReply(call_id, error=f"{type(error).__name__}: {error}") if error is not None \
                else SnapshotReply(call_id, snapshot=future.result())
            self._replies.append(reply)
        return done

    def _send(self, outputs: list[RequestOutput]) -> None:
        replies, self._replies = self._replies, []
        for reply in replies:
            self.end.send(reply)
        state = self._changed_state()
        metrics = self.recorder.take()
        if outputs or metrics is not None or state is not None:
            self.end.send(StepOut(outputs, metrics, state))

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

    def _parent_alive(self) -> bool:
        now = time.monotonic()
        if now - self._parent_at < PARENT_CHECK_S:
            return True
        self._parent_at = now
        if os.getppid() != self._parent_pid:
            log.error("the server process %d is gone: the engine process exits", self._parent_pid)
            return False
        return True
