"""`python -m server.engine_host.main`: the engine process of one server (started by process.py).

It runs `run_engine` as the engine thread does, until `Shutdown` or until the HTTP process is gone.
A load failure is logged, reported (`LoadFailed`) and ends the process with 1."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import time

import msgspec

from server.engine_host.link import EngineEnd
from server.engine_host.loop import run_engine
from server.engine_host.process import Launch
from server.exit import exit_now
from server.telemetry.kv_events import KvEventSource

log = logging.getLogger("server.engine_host")

_PR_SET_PDEATHSIG = 1
FLUSH_S = 0.5  # the last message (LoadFailed) gets this long to leave before the process exits
PARENT_CHECK_S = 1.0


def die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL this process when the HTTP process dies (even by SIGKILL)."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if os.getppid() != parent_pid:  # it died before prctl took effect
        os._exit(1)


class ParentWatch:
    """A backstop to the parent-death signal: False once the HTTP process is gone."""

    def __init__(self, parent_pid: int) -> None:
        self._parent_pid, self._at = parent_pid, 0.0

    def __call__(self) -> bool:
        now = time.monotonic()
        if now - self._at < PARENT_CHECK_S:
            return True
        self._at = now
        if os.getppid() != self._parent_pid:
            log.error("the server process %d is gone: the engine process exits", self._parent_pid)
            return False
        return True


def main() -> int:
    launch = msgspec.json.decode(sys.stdin.buffer.read(), type=Launch)
    die_with_parent(launch.parent_pid)
    for sig in (signal.SIGINT, signal.SIGTERM):  # the HTTP process drains, then stops this one
        signal.signal(sig, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s [engine] %(name)s: %(message)s")
    end = EngineEnd(launch.directory, bytes.fromhex(launch.secret))
    try:
        from server.engine_host.build import build_core, event_publisher  # heavy: after the link is up

        cfg = launch.config
        kv_events = KvEventSource(event_publisher(cfg, launch.epoch), launch.epoch)  # the server's epoch
        loaded = run_engine(end, lambda: build_core(cfg, None, end.wake), kv_events,
                            alive=ParentWatch(launch.parent_pid)) is not None
        if not loaded:
            time.sleep(FLUSH_S)
    finally:
        end.close()
    return 0 if loaded else 1


if __name__ == "__main__":
    exit_now(main())
