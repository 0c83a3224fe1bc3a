"""Backend servers as the router sees them: health, load and (for kv_cache_aware) cached block hashes.

A backend that refuses a connection or fails its health check is fenced (skipped by every policy)
until a later health check succeeds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from server.router.http_client import HttpClient, HttpError

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Backend:
    url: str  # "http://host:port"
    role: str  # "context" | "generation" | "aggregated"
    healthy: bool = False
    active: int = 0  # requests in flight through this router
    cached_hashes: frozenset[str] = frozenset()
    hash_salt: str = ""
    tokens_per_block: int = 0
    last_error: str = ""
    last_checked: float = field(default=0.0)

    def fence(self, reason: str) -> None:
        if self.healthy:
            log.warning("fencing %s backend %s: %s", self.role, self.url, reason)
        self.healthy = False
        self.last_error = reason


class HealthMonitor:
    """Polls every backend's /health (and, if asked, its cached block hashes) on an interval."""

    def __init__(self, backends: list[Backend], client: HttpClient, *, interval_s: float = 1.0,
                 timeout_s: float = 2.0, poll_hashes: bool = False, headers: dict[str, str] | None = None) -> None:
        self.backends = backends
        self.headers = headers or {}  # the deployment token: the cache index is internal
        self.client = client
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.poll_hashes = poll_hashes
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
            response = await self.client.request("GET", f"{backend.url}/health", timeout=self.timeout_s)
            ok = response.status == 200
        except HttpError as exc:
            ok, response = False, None
            backend.last_error = f"{type(exc).__name__}: {exc}"
        if not ok:
            reason = backend.last_error if response is None else f"/health returned {response.status}"
            backend.fence(reason)
        elif not backend.healthy:
            log.info("%s backend %s is healthy", backend.role, backend.url)
            backend.healthy = True
        backend.last_checked = time.monotonic()
        if ok and self.poll_hashes and backend.role == "context":
            await self._fetch_hashes(backend)

    async def _fetch_hashes(self, backend: Backend) -> None:
        try:
            response = await self.client.request("GET", f"{backend.url}/kv_cache/hashes", headers=self.headers,
                                                 timeout=self.timeout_s)
            body = response.json()
            backend.cached_hashes = frozenset(body["hashes"])
            backend.hash_salt = body["salt"]
            backend.tokens_per_block = int(body["tokens_per_block"])
        except (HttpError, ValueError, KeyError, TypeError) as exc:
            log.warning("could not read cached block hashes of %s: %s", backend.url, exc)

    async def _loop(self) -> None:
        while True:
            await self.check_all()
            await asyncio.sleep(self.interval_s)
