"""Starting and stopping a server's engine process.

The child is `python -m server.engine_host.main` (fork + exec: a parent with CUDA is never forked),
in the server's process group. Its `Launch` comes on stdin (the token and link secret never go on
argv). It ignores SIGINT and SIGTERM so the HTTP process drains first, then stops it with
`Shutdown` and SIGKILL after `timeout_s`."""

from __future__ import annotations

import logging
import subprocess
import sys

import msgspec

from server.config.schema import ServerConfig

log = logging.getLogger(__name__)

MODULE = "server.engine_host.main"
KILL_WAIT_S = 5.0


class Launch(msgspec.Struct, frozen=True):
    config: ServerConfig
    directory: str  # the private directory of the link's ipc sockets (server/engine_host/link.py)
    secret: str  # hex: the link's HMAC secret (server/engine_host/wire.py)
    epoch: str  # the server's epoch (/health): its KV events carry it
    parent_pid: int  # the HTTP process: the child exits when it is gone


def start_engine_process(launch: Launch) -> subprocess.Popen:
    """Start the child and hand it `launch` (call on the main thread: the parent-death signal
    the child asks for fires when the thread that started it ends)."""
    proc = subprocess.Popen([sys.executable, "-m", MODULE], stdin=subprocess.PIPE, close_fds=True)
    try:
        proc.stdin.write(msgspec.json.encode(launch))
        proc.stdin.close()
    except OSError as exc:  # it died at once: the HTTP process sees it exit before it was ready
        log.error("could not hand the engine process its launch settings: %s", exc)
    return proc


def stop_engine_process(proc: subprocess.Popen, timeout_s: float) -> int:
    """Wait for the child to exit (after its Shutdown) at most `timeout_s`, then SIGKILL it."""
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        if timeout_s > 0:
            log.warning("the engine process (pid %d) did not stop within %g s: SIGKILL", proc.pid, timeout_s)
        proc.kill()
        return proc.wait(timeout=KILL_WAIT_S)
