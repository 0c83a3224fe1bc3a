"""`EngineProcess`: the engine's front over the ipc link when the engine runs in its own process
(`engine_process`). If the child dies, every request in flight ends with a 503 and `on_fatal()` makes
the server exit non-zero (the launcher restarts it); before `Ready`, its death or `LoadFailed` is a
`load_error`. The child, `python -m server.engine_host.main` in the server's process group (fork +
exec: a parent with CUDA is never forked), gets its `Launch` on stdin (the token and link secret never
go on argv) and ignores SIGINT and SIGTERM: the HTTP process drains first, then sends `Shutdown` and
SIGKILLs it after a timeout."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import subprocess
import sys
from collections.abc import Callable

import msgspec

from server.config.schema import ServerConfig
from server.engine_host.front import EngineFront
from server.engine_host.link import HttpEnd, private_dir
from server.engine_host.wire import KEY_BYTES, EngineInfo, Shutdown
from server.exit import exit_text
from server.telemetry.metrics import ServerMetrics

log = logging.getLogger(__name__)

MODULE = "server.engine_host.main"
POLL_S = 0.2  # the reader looks at the child's exit status when nothing arrived for this long
STOP_TIMEOUT_S = 10.0
KILL_WAIT_S = 5.0


class Launch(msgspec.Struct, frozen=True):
    config: ServerConfig
    directory: str  # the private directory of the link's ipc sockets (server/engine_host/link.py)
    secret: str  # hex: the link's HMAC secret (server/engine_host/wire.py)
    epoch: str  # the server's epoch (/health): its KV events carry it
    parent_pid: int  # the HTTP process: the child exits when it is gone


class EngineProcess(EngineFront):
    def __init__(self, cfg: ServerConfig, model_name: str, metrics: ServerMetrics, epoch: str,
                 on_fatal: Callable[[], None]) -> None:
        super().__init__(model_name, cfg.max_seq_len, metrics)
        self.exit_code: int | None = None  # set once the child ended
        self._cfg, self._epoch, self._on_fatal = cfg, epoch, on_fatal
        self.tokenizer = None  # loaded once the engine is Ready
        self._end: HttpEnd | None = None
        self._proc = None
        self._tasks: list[asyncio.Task] = []
        self._stopping = False

    # ---- lifecycle (event loop thread: the main thread)
    def start(self) -> None:
        """Start the child and hand it its `Launch` (on the main thread: the parent-death signal the
        child asks for fires when the thread that started it ends)."""
        secret = secrets.token_bytes(KEY_BYTES)
        directory = private_dir()
        self._end = HttpEnd(directory, secret)
        self._proc = subprocess.Popen([sys.executable, "-m", MODULE], stdin=subprocess.PIPE, close_fds=True)
        try:
            self._proc.stdin.write(msgspec.json.encode(Launch(self._cfg, str(directory), secret.hex(), self._epoch,
                                                              os.getpid())))
            self._proc.stdin.close()
        except OSError as exc:  # it died at once: the reader sees it exit before it was ready
            log.error("could not hand the engine process its launch settings: %s", exc)
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
            self.exit_code = await asyncio.to_thread(_stop_child, self._proc, timeout_s if graceful else 0.0)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._end_all("the server is shutting down")
        if self._end is not None:
            self._end.close()

    # ---- EngineClient
    def is_ready(self) -> bool:
        return self.tokenizer is not None and self.exit_code is None and not self._stopping

    def idle(self) -> bool:
        return self.exit_code is not None or super().idle()

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
        self._on_fatal()

    def _on_ready(self, info: EngineInfo) -> None:
        self._tasks.append(asyncio.create_task(self._load_tokenizer(info)))

    async def _load_tokenizer(self, info: EngineInfo) -> None:
        from transformers import AutoTokenizer

        try:
            self.tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, info.model_dir)
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
        if self.tokenizer is None:  # not ready yet: a load failure (serve.py's watcher ends the server)
            self.load_error = self.load_error or RuntimeError(f"{reason} before it was ready (its log says why)")
            return
        log.error("%s: failing %d requests in flight; the server exits", reason, len(self._streams))
        self._end_all(f"{reason}; this server is restarting", 503)
        for answer in self._calls.values():
            if not answer.done():
                answer.set_exception(ConnectionError(reason))
        self._on_fatal()


def _stop_child(proc: subprocess.Popen, timeout_s: float) -> int:
    """Wait for the child to exit (after its Shutdown) at most `timeout_s`, then SIGKILL it."""
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        if timeout_s > 0:
            log.warning("the engine process (pid %d) did not stop within %g s: SIGKILL", proc.pid, timeout_s)
        proc.kill()
        return proc.wait(timeout=KILL_WAIT_S)
