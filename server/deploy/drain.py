"""Graceful drain on SIGTERM, for an engine server and for the router.

SIGTERM: /health answers 503 `draining` and new requests on the admission routes get 503 (code
`draining`); internal routes keep answering, so generation servers still pull a draining context
server's leases. Requests in flight and what `idle` watches (queued requests, leases, pulls) end
within `timeout_s`; then uvicorn shuts down as usual (exit 0). A second SIGTERM, or SIGINT, stops
at once."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import time
from collections.abc import Callable
from contextlib import suppress

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from server.openai.errors import error_response

log = logging.getLogger(__name__)

ADMISSION_PATHS = ("/v1/completions", "/v1/chat/completions")
POLL_S = 0.05
DRAINING_MESSAGE = ("this server is draining (shutting down): it takes no new requests; requests already "
                    "running finish. Retry on another server")


class Drain:
    def __init__(self, timeout_s: float, idle: Callable[[], bool] = lambda: True) -> None:
        self.timeout_s = timeout_s
        self.idle = idle  # True when the process has nothing left to finish besides HTTP requests
        self.in_flight = 0
        self.started: float | None = None  # monotonic, once draining

    @property
    def draining(self) -> bool:
        return self.started is not None

    def begin(self) -> None:
        if self.started is None:
            self.started = time.monotonic()
            log.warning("SIGTERM: draining (%d requests in flight, at most %g s)", self.in_flight, self.timeout_s)

    def report(self) -> dict:
        """The /health body while draining."""
        left = max(0.0, self.timeout_s - (time.monotonic() - (self.started or 0.0)))
        return {"status": "draining", "in_flight": self.in_flight, "seconds_left": round(left, 1),
                "detail": "no new requests; those in flight and their KV transfers finish, then the process exits"}

    def done(self) -> bool:
        return self.in_flight == 0 and self.idle()

    async def run(self, exit_now: Callable[[], None]) -> None:
        """Wait until nothing is left (twice in a row: a request between the gate and the engine
        is not missed) or the timeout, then `exit_now()`."""
        self.begin()
        deadline = self.started + self.timeout_s
        quiet = 0
        while time.monotonic() < deadline and quiet < 2:
            quiet = quiet + 1 if self.done() else 0
            await asyncio.sleep(POLL_S)
        if quiet < 2:
            log.warning("drain timeout (%g s): %d requests still in flight; exiting", self.timeout_s, self.in_flight)
        else:
            log.warning("drained in %.1f s; exiting", time.monotonic() - self.started)
        exit_now()


class DrainGate:
    """ASGI middleware: counts requests on the admission routes and refuses new ones while draining."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in ADMISSION_PATHS:
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            refusal = error_response(503, DRAINING_MESSAGE, code="draining", headers={"connection": "close"})
            await refusal(scope, receive, send)
            return
        self.drain.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.in_flight -= 1


class DrainingServer(uvicorn.Server):
    """uvicorn serving `app`, except that the first SIGTERM drains (`app.state.drain`) before the usual
    shutdown, and that `on_listening()` is called (on the event loop) once the app has started and the
    socket listens."""

    def __init__(self, app: ASGIApp, host: str, port: int, on_listening: Callable[[], None] | None = None) -> None:
        super().__init__(uvicorn.Config(app, host=host, port=port, log_level="warning", ws="none",
                                        timeout_graceful_shutdown=5, access_log=False))
        self.drain: Drain = app.state.drain
        self.on_listening = on_listening
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None

    def run_on(self, sock: socket.socket) -> None:
        with suppress(KeyboardInterrupt):  # uvicorn raises the SIGINT it handled again, after its clean shutdown
            self.run(sockets=[sock])

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and not self.should_exit and self.on_listening is not None:
            self.on_listening()

    def handle_exit(self, sig: int, frame) -> None:
        if sig == signal.SIGTERM and not self.drain.draining and not self.should_exit and self._loop is not None:
            self.drain.begin()  # at once: the next /health and the next request see it
            self._loop.call_soon_threadsafe(self._start_drain)
            return
        super().handle_exit(sig, frame)

    def _start_drain(self) -> None:
        self._task = asyncio.ensure_future(self.drain.run(self._exit))

    def _exit(self) -> None:
        self.should_exit = True
