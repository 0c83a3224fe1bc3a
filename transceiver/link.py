"""The one ZeroMQ wrapper of pdserve: a thread owning its sockets (not thread-safe), fed through
bounded queues (`submit`; `drain`/`wait`). Linger is 0; every wait is a poll with a timeout. A
handler reacts to commands, messages and ticks through `SocketIO`; `pump(io)`, if it has one, runs
every turn and says how soon it wants the next (None: when something arrives). Its exceptions are
logged, never fatal.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from typing import Any, Protocol

import zmq

log = logging.getLogger(__name__)

MAX_READS_PER_SOCKET = 64  # messages read from one socket before looking at commands again
BACKOFF_S = 0.001  # poll timeout while a send or a delivery is held back
OUTBOX_SIZE = 1024  # commands queued for a socket thread before `submit` blocks


def shared_context() -> zmq.Context:
    """The process's single zmq context (never terminated by pdserve; sockets are closed instead)."""
    return zmq.Context.instance()


class LinkHandler(Protocol):
    def setup(self, io: SocketIO) -> None: ...
    def on_command(self, io: SocketIO, cmd: Any) -> None: ...
    def on_frames(self, io: SocketIO, key: Hashable, frames: list[zmq.Frame]) -> None: ...
    def on_unroutable(self, io: SocketIO, key: Hashable, frames: list[Any]) -> None: ...
    def on_tick(self, io: SocketIO, now: float) -> None: ...


class SocketIO:
    """The socket thread's own view of its sockets; only handler methods (in that thread) use it."""

    def __init__(self, inbox: queue.Queue, notify: Callable[[], None] | None = None) -> None:
        self.ctx = shared_context()
        self._notify = notify  # tells the engine thread that items arrived (it may be sleeping)
        self.sockets: dict[Hashable, zmq.Socket] = {}
        self._pending_sends: dict[Hashable, deque[list[Any]]] = {}
        self._pending_deliveries: deque[Any] = deque()
        self._inbox = inbox

    def socket(self, key: Hashable, kind: int) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        self.sockets[key] = sock
        self._pending_sends[key] = deque()
        return sock

    def close(self, key: Hashable) -> None:
        sock = self.sockets.pop(key, None)
        self._pending_sends.pop(key, None)
        if sock is not None:
            sock.close(linger=0)

    def send(self, key: Hashable, frames: list[Any]) -> None:
        """Send a multipart message now, or hold it (in order) until the peer's pipe has room."""
        pending = self._pending_sends.get(key)
        if pending is None:
            return  # socket closed meanwhile: the message has nowhere to go
        pending.append(frames)
        self.flush_sends(key)

    def deliver(self, item: Any) -> None:
        """Hand an item to the engine thread; when its inbox is full, hold it and stop reading."""
        self._pending_deliveries.append(item)
        self.flush_deliveries()

    def flush_deliveries(self) -> None:
        delivered = False
        while self._pending_deliveries:
            try:
                self._inbox.put_nowait(self._pending_deliveries[0])
            except queue.Full:
                break
            self._pending_deliveries.popleft()
            delivered = True
        if delivered and self._notify is not None:
            self._notify()

    def flush_sends(self, key: Hashable) -> list[list[Any]]:
        """Send what is pending on `key`; returns the messages the socket could not route."""
        pending, sock, unroutable = self._pending_sends[key], self.sockets[key], []
        while pending:
            try:
                sock.send_multipart(pending[0], flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            except zmq.ZMQError as e:
                if e.errno != errno.EHOSTUNREACH:
                    raise
                unroutable.append(pending[0])
            pending.popleft()
        return unroutable

    @property
    def held_back(self) -> bool:
        return bool(self._pending_deliveries) or any(self._pending_sends.values())


class LinkOwner:
    """What a KV sender or receiver tells /health about its socket thread."""

    _thread: SocketThread

    @property
    def link_alive(self) -> bool:
        """False once the socket thread has died: no pull is served or made (the server reports it)."""
        return self._thread.running

    @property
    def link_name(self) -> str:
        return self._thread.name


class SocketThread:

    def __init__(self, name: str, handler: LinkHandler, *, inbox_size: int = 256, tick_s: float = 0.05,
                 notify: Callable[[], None] | None = None) -> None:
        self._handler = handler
        self._notify = notify
        self._inbox: queue.Queue = queue.Queue(maxsize=inbox_size)
        self._outbox: queue.Queue = queue.Queue(maxsize=OUTBOX_SIZE)
        self._early: deque[Any] = deque()  # items `wait` took from the inbox before `drain`
        self._tick_s = tick_s
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._setup_error: BaseException | None = None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self, timeout_s: float = 10.0) -> None:
        """Start the thread and wait until the handler's `setup` (bind, ...) has finished."""
        self._thread.start()
        if not self._ready.wait(timeout_s):
            self.close()
            raise TimeoutError(f"{self._thread.name}: socket thread did not start within {timeout_s}s")
        if self._setup_error is not None:
            self.close()
            raise self._setup_error

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    @property
    def name(self) -> str:
        return self._thread.name

    def submit(self, cmd: Any, timeout_s: float = 10.0) -> None:
        """Queue a command for the socket thread (blocks at most `timeout_s` when the queue is full)."""
        if not self._thread.is_alive():
            raise RuntimeError(f"{self._thread.name}: socket thread is not running")
        try:
            self._outbox.put(cmd, timeout=timeout_s)
        except queue.Full:
            raise RuntimeError(f"{self._thread.name}: command queue full for {timeout_s}s") from None
        self._wake()

    def drain(self) -> list[Any]:
        """Every item delivered so far (engine thread)."""
        items = list(self._early)
        self._early.clear()
        while True:
            try:
                items.append(self._inbox.get_nowait())
            except queue.Empty:
                return items

    def wait(self, timeout_s: float) -> bool:
        """Block until an item is delivered (True) or `timeout_s` passes (False)."""
        if self._early or not self._inbox.empty():
            return True
        try:
            self._early.append(self._inbox.get(timeout=timeout_s))
        except queue.Empty:
            return False
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread; it closes its sockets (linger 0) on the way out."""
        self._stop.set()
        self._wake()
        if self._thread.is_alive() or self._thread.ident is not None:
            self._thread.join(timeout_s)
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._wake_r = self._wake_w = -1

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # pipe full (already woken) or closed (shutting down)
            os.write(self._wake_w, b"\0")

    def _run(self) -> None:
        io = SocketIO(self._inbox, self._notify)
        try:
            self._handler.setup(io)
        except BaseException as e:  # reported to `start` in the creating thread
            self._setup_error = e
            self._ready.set()
            self._close_all(io)
            return
        self._ready.set()
        try:
            self._loop(io)
        except BaseException:  # `running` turns False: the server reports it unhealthy (/health)
            log.exception("%s: socket thread died", self._thread.name)
            raise
        finally:
            self._close_all(io)

    def _loop(self, io: SocketIO) -> None:
        next_tick = time.monotonic()
        pump = getattr(self._handler, "pump", None)
        while not self._stop.is_set():
            self._guard(self._flush, io)
            poller = zmq.Poller()
            poller.register(self._wake_r, zmq.POLLIN)
            reading = not io._pending_deliveries
            if reading:
                for sock in io.sockets.values():
                    poller.register(sock, zmq.POLLIN)
            timeout = BACKOFF_S if io.held_back else max(0.0, next_tick - time.monotonic())
            if pump is not None:
                again = self._guard(pump, io)
                timeout = timeout if again is None else min(timeout, again)
            events = dict(poller.poll(timeout * 1000))
            if self._wake_r in events:
                self._drain_wake_pipe()
            self._run_commands(io)
            if reading:
                self._read_ready(io, events)
            if time.monotonic() >= next_tick:
                self._guard(self._handler.on_tick, io, time.time())
                next_tick = time.monotonic() + self._tick_s

    def _flush(self, io: SocketIO) -> None:
        io.flush_deliveries()
        for key in list(io.sockets):
            for frames in io.flush_sends(key):
                self._handler.on_unroutable(io, key, frames)

    def _run_commands(self, io: SocketIO) -> None:
        while True:
            try:
                cmd = self._outbox.get_nowait()
            except queue.Empty:
                return
            self._guard(self._handler.on_command, io, cmd)

    def _read_ready(self, io: SocketIO, events: dict) -> None:
        for key, sock in list(io.sockets.items()):
            if sock not in events:
                continue
            for _ in range(MAX_READS_PER_SOCKET):
                if io._pending_deliveries or key not in io.sockets:
                    return
                try:
                    frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self._guard(self._handler.on_frames, io, key, frames)

    def _drain_wake_pipe(self) -> None:
        with contextlib.suppress(OSError):  # BlockingIOError once it is empty
            while os.read(self._wake_r, 4096):
                pass

    def _guard(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception:
            log.exception("%s: handler error (message dropped)", self._thread.name)
            return None

    def _close_all(self, io: SocketIO) -> None:
        for key in list(io.sockets):
            io.close(key)
