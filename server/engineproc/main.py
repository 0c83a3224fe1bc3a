"""`python -m server.engineproc.main`: the engine process of one server (started by spawn.py).

It builds what `AsyncEngine` builds on its thread (`server.deploy.serve.build_core`: weights, KV
manager, runner, connector and transceiver threads, and a tensor-parallel server's other ranks, whose
rank 0 this process is; the KV event publisher; the metrics bridge),
tells the HTTP process `Ready`, runs the step loop (server/engineproc/child.py) until `Shutdown`,
then closes the transceiver and the publisher. A load failure is logged, reported (`LoadFailed`)
and ends the process with 1.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import time

from server.engine import status
from server.engineproc.child import EngineHost
from server.engineproc.link import EngineEnd
from server.engineproc.spawn import Launch, read_launch
from server.engineproc.wire import EngineInfo, LoadFailed, Ready
from server.telemetry.bridge import TelemetryBridge
from server.telemetry.kv_events import KvEventSource
from server.telemetry.relay import MetricsRecorder

log = logging.getLogger("server.engineproc")

_PR_SET_PDEATHSIG = 1
FLUSH_S = 0.5  # the last message (LoadFailed) gets this long to leave before the process exits


def die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL this process when the HTTP process dies (even by SIGKILL)."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if os.getppid() != parent_pid:  # it died before prctl took effect
        os._exit(1)


def build_host(launch: Launch, end: EngineEnd) -> EngineHost:
    from server.deploy.serve import build_core, event_publisher  # heavy (torch, the model): after the link is up

    cfg = launch.config
    recorder = MetricsRecorder()
    bridge = TelemetryBridge(recorder)
    publisher = event_publisher(cfg, launch.epoch)  # the server's epoch, not this process's
    kv_events = KvEventSource(publisher, launch.epoch)
    kv_events.wake = end.wake
    if publisher is not None:
        publisher.start()
    core = build_core(cfg, recorder, end.wake)
    kv_events.attach(core.kv)
    return EngineHost(core, end, recorder, bridge, kv_events, launch.parent_pid)


def ready(host: EngineHost, launch: Launch) -> Ready:
    from server.models.builtin import resolve_model

    publisher = host.kv_events.publisher
    info = EngineInfo(model_dir=str(resolve_model(launch.config.model)), vocab_size=host.core.runner.spec.vocab_size,
                      pid=os.getpid(), kv_events_endpoint=publisher.endpoint if publisher is not None else None)
    return Ready(info, host.state())


def close(host: EngineHost) -> None:
    """After the loop: fail what the transceiver still runs with an explicit message, close sockets
    and the KV manager, stop a tensor-parallel engine's other ranks."""
    from server.deploy.serve import stop_ranks

    for link in status.transceiver(host.core):
        if link is not None:
            link.close()
    if host.kv_events.publisher is not None:
        host.kv_events.publisher.close()
    host.core.kv.close()  # the disk tier's queued writes land (a restart finds them)
    stop_ranks(host.core)


def main() -> int:
    launch = read_launch(sys.stdin.buffer.read())
    die_with_parent(launch.parent_pid)
    for sig in (signal.SIGINT, signal.SIGTERM):  # the HTTP process drains, then stops this one
        signal.signal(sig, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s [engine] %(name)s: %(message)s")
    end = EngineEnd(launch.directory, bytes.fromhex(launch.secret))
    try:
        host = build_host(launch, end)
    except BaseException as exc:
        log.exception("engine failed to load")
        end.send(LoadFailed(f"{type(exc).__name__}: {exc}"))
        time.sleep(FLUSH_S)
        return 1
    end.send(ready(host, launch))
    log.info("engine process %d serving the server process %d", os.getpid(), launch.parent_pid)
    try:
        host.run()
    finally:
        close(host)
        end.close()
    return 0


def exit_now(code: int) -> None:
    """Everything is closed: skip the interpreter's teardown (torch's takes seconds), so a server
    that stops or restarts does not wait for it."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
