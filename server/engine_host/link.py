"""The two ends of the engine link's sockets (messages and sealing: server/engine_host/wire.py).

The HTTP process binds both pipes in a private 0700 directory before it starts the engine process.
Each end's sockets are used by one thread only. Sends never block (no high-water mark: the reader
drains every turn); every receive has a timeout. Messages a side cannot open are dropped and counted."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from contextlib import suppress
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from server.engine_host.wire import FROM_ENGINE, TO_ENGINE, link_codec
from transceiver.link import shared_context
from transceiver.signed import Rejected, SignedCodec

log = logging.getLogger(__name__)

MAX_MESSAGES_PER_READ = 256  # the HTTP end hands the loop back after this many


def private_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="pdserve-engine-"))  # mode 0700


def address(directory: str | Path, pipe: str) -> str:
    return f"ipc://{Path(directory) / pipe}"


def _socket(ctx: zmq.Context, kind: int) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM if kind == zmq.PUSH else zmq.RCVHWM, 0)
    return sock


class _Opener:
    def __init__(self, codec: SignedCodec) -> None:
        self.codec = codec
        self.rejected = 0

    def open(self, frames: list[bytes]) -> Any | None:
        try:
            if len(frames) != 2:
                raise Rejected("malformed", f"{len(frames)} frames, not 2")
            return self.codec.open(*frames)[1]
        except Rejected as exc:
            self.rejected += 1
            log.warning("engine link: dropped a message (%s)", exc)
            return None


class HttpEnd(_Opener):
    """The HTTP process's end: binds both pipes in `directory`; event loop thread only."""

    def __init__(self, directory: Path, secret: bytes) -> None:
        super().__init__(link_codec(secret, engine_side=False))
        self.directory = directory
        self._push = _socket(shared_context(), zmq.PUSH)
        self._pull = _socket(zmq.asyncio.Context.shadow(shared_context()), zmq.PULL)
        self._push.bind(address(directory, TO_ENGINE))
        self._pull.bind(address(directory, FROM_ENGINE))

    def send(self, message) -> bool:
        """False when the engine end is not connected (not yet, or not any more)."""
        try:
            self._push.send_multipart(self.codec.seal(message), flags=zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    async def receive(self, timeout_s: float) -> list[Any]:
        """The messages that arrived (at most MAX_MESSAGES_PER_READ), waiting at most `timeout_s`."""
        if not await self._pull.poll(timeout_s * 1000, zmq.POLLIN):
            return []
        messages = []
        for _ in range(MAX_MESSAGES_PER_READ):
            try:
                frames = await self._pull.recv_multipart(flags=zmq.NOBLOCK)  # ready at once, or Again
            except zmq.Again:
                break
            message = self.open(frames)
            if message is not None:
                messages.append(message)
        return messages

    def close(self) -> None:
        for sock in (self._push, self._pull):
            sock.close(linger=0)
        shutil.rmtree(self.directory, ignore_errors=True)


class EngineEnd(_Opener):
    """The engine process's end (engine loop thread only; `wake`, from any thread, ends a `receive` wait)."""

    def __init__(self, directory: str, secret: bytes) -> None:
        super().__init__(link_codec(secret, engine_side=True))
        ctx = shared_context()
        self._pull = _socket(ctx, zmq.PULL)
        self._push = _socket(ctx, zmq.PUSH)
        self._pull.connect(address(directory, TO_ENGINE))
        self._push.connect(address(directory, FROM_ENGINE))
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poller = zmq.Poller()
        self._poller.register(self._pull, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)

    def wake(self) -> None:
        with suppress(BlockingIOError, OSError):  # the pipe is full (a wake-up is pending already) or closed
            os.write(self._wake_w, b"\0")

    def receive(self, timeout_s: float) -> list[Any]:
        """Every message waiting, after waiting at most `timeout_s` for one (or a wake-up)."""
        events = dict(self._poller.poll(timeout_s * 1000)) if timeout_s > 0 else {}
        if self._wake_r in events:
            with suppress(BlockingIOError, OSError):
                while os.read(self._wake_r, 4096):
                    pass
        messages = []
        while True:
            try:
                frames = self._pull.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return messages
            message = self.open(frames)
            if message is not None:
                messages.append(message)

    def send(self, message) -> None:
        self._push.send_multipart(self.codec.seal(message), flags=zmq.NOBLOCK)

    def close(self) -> None:
        for sock in (self._pull, self._push):
            sock.close(linger=0)
        for fd in (self._wake_r, self._wake_w):
            with suppress(OSError):
                os.close(fd)
