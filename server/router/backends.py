"""Backend servers as the router sees them: health, load, and what their caches hold (`kv_index`).

A backend that refuses a connection or fails its health check is fenced (skipped by every policy)
until a later check succeeds. A changed /health `epoch` counts as a restart of the server."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from server.router.http_client import HttpClient, HttpError, Response
from server.router.kv_index import KvIndex

log = logging.getLogger(__name__)
CHECK_TIMEOUT_S = 2.0


@dataclass(eq=False)
class Backend:
    url: str  # "http://host:port"
    role: str  # "context" | "generation" | "aggregated"
    healthy: bool = False
    active: int = 0  # legs in flight through this router (server/router/queue.py books them)
    load_tokens: int = 0  # their tokens still to compute here, as estimated when booked
    kv_index: KvIndex = field(default_factory=KvIndex)
    last_error: str = ""
    status: str = ""  # the /health body's "status" ("ok", "draining"), else what went wrong
    epoch: str = ""  # the /health body's "epoch": changes when the server restarts
    restarts: int = 0  # epoch changes seen

    def note_health(self, response: Response | None) -> None:
        """Keep the status and epoch a /health answer reports (`None`: the server did not answer)."""
        if response is None:
            self.status = "unreachable"
            return
        body = _json_object(response)
        status = body.get("status")
        self.status = status if isinstance(status, str) else f"HTTP {response.status}"
        epoch = body.get("epoch")
        if isinstance(epoch, str) and epoch:
            if self.epoch and epoch != self.epoch:
                self.restarts += 1
            self.epoch = epoch

    def fence(self, reason: str) -> None:
        if self.healthy:
            log.warning("fencing %s backend %s: %s", self.role, self.url, reason)
        self.healthy = False
        self.last_error = reason


class HealthMonitor:
    """Polls every backend's /health on an interval."""

    def __init__(self, backends: list[Backend], client: HttpClient, *, interval_s: float = 1.0) -> None:
        self.backends, self.client, self.interval_s = backends, client, interval_s
        self.on_round: Callable[[], Awaitable[None]] | None = None  # after each round of checks
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(b) for b in self.backends))

    async def check(self, backend: Backend) -> None:
        try:
            response = await self.client.request("GET", f"{backend.url}/health", timeout=CHECK_TIMEOUT_S)
        except HttpError as exc:
            response = None
            backend.last_error = f"{type(exc).__name__}: {exc}"
        backend.note_health(response)
        if response is None or response.status != 200:
            backend.fence(backend.last_error if response is None else _unhealthy(response))
        elif not backend.healthy:
            log.info("%s backend %s is healthy", backend.role, backend.url)
            backend.healthy = True

    async def _loop(self) -> None:
        while True:
            await self.check_all()
            if self.on_round is not None:
                try:
                    await self.on_round()
                except Exception:  # a failing observer must not stop the health checks
                    log.exception("health monitor round hook failed")
            await asyncio.sleep(self.interval_s)


def _json_object(response: Response) -> dict:
    try:
        body = response.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def _unhealthy(response: Response) -> str:
    """`/health returned 503: <the server's reason>` (an engine names the KV check that failed)."""
    body = _json_object(response)
    error = body.get("error")
    detail = body.get("reason") or (error.get("message") if isinstance(error, dict) else None)
    return f"/health returned {response.status}" + (f": {detail}" if detail else "")
