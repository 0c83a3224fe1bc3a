"""Generation side: the KV endpoints of this deployment's context servers, asked of them
(`GET /kv_cache/endpoint`; docs/SECURITY.md).

An unknown endpoint triggers one shared refresh; a background task refreshes every INTERVAL_S,
and endpoints stay known after their server dies (a pull then fails as unreachable, not foreign).
One HTTP client serves every refresh (building one costs tens of milliseconds of the event loop)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

import httpx

from server.auth import token_headers

log = logging.getLogger(__name__)
ENDPOINT_PATH = "/kv_cache/endpoint"
TIMEOUT_S = 2.0
INTERVAL_S = 2.0  # the background refresh's


class ContextDirectory:
    def __init__(self, context_urls: Sequence[str], token: str | None, *, min_refresh_s: float = 0.5) -> None:
        self.context_urls = tuple(u if u.startswith("http") else f"http://{u}" for u in context_urls)
        self._headers = token_headers(token)
        self._min_refresh_s = min_refresh_s
        self._endpoints: dict[str, str] = {}  # context URL -> its KV endpoint
        self._last_refresh = float("-inf")
        self._lock = asyncio.Lock()
        self._task: asyncio.Task | None = None
        self._nudged: asyncio.Task | None = None
        self._client: httpx.AsyncClient | None = None  # made on the first refresh, in the server's loop
        self.on_refresh: Callable[[], None] | None = None  # runs after every refresh

    def start(self) -> None:
        """Refresh in the background until `stop` (call from the server's event loop)."""
        self._task = asyncio.create_task(self._keep_fresh())

    async def stop(self) -> None:
        for task in (self._task, self._nudged):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    def nudge(self) -> None:
        """Refresh soon (at most once per `min_refresh_s`), without waiting for the interval."""
        if self._nudged is None or self._nudged.done():
            self._nudged = asyncio.create_task(self._refresh_if_due())

    async def _refresh_if_due(self) -> None:
        async with self._lock:
            if time.monotonic() - self._last_refresh >= self._min_refresh_s:
                await self.refresh()

    def endpoint_of(self, url: str) -> str | None:
        return self._endpoints.get(url)

    async def _keep_fresh(self) -> None:
        while True:
            async with self._lock:
                await self.refresh()
            await asyncio.sleep(INTERVAL_S)

    @property
    def endpoints(self) -> frozenset[str]:
        return frozenset(self._endpoints.values())

    async def knows(self, endpoint: str) -> bool:
        """True if `endpoint` is the KV endpoint of one of the deployment's context servers. An unknown
        one triggers a refresh, unless one started since this call began (concurrent calls share it)."""
        if endpoint in self.endpoints:
            return True
        asked = time.monotonic()
        async with self._lock:
            if endpoint not in self.endpoints and self._last_refresh < asked:
                await self.refresh()
        return endpoint in self.endpoints

    async def refresh(self) -> None:
        self._last_refresh = time.monotonic()
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=TIMEOUT_S, trust_env=False)
        found = await asyncio.gather(*(self._ask(self._client, url) for url in self.context_urls))
        for url, endpoint in zip(self.context_urls, found, strict=True):
            if endpoint is not None:
                self._endpoints[url] = endpoint
        if self.on_refresh is not None:
            try:
                self.on_refresh()
            except Exception:  # a failing hook must not stop the refreshes
                log.exception("context directory: on_refresh failed")

    async def _ask(self, client: httpx.AsyncClient, url: str) -> str | None:
        try:
            response = await client.get(url + ENDPOINT_PATH, headers=self._headers)
            endpoint = response.json().get("endpoint") if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            log.info("context server %s did not say its KV endpoint: %s", url, exc)
            return None
        if not isinstance(endpoint, str):
            log.warning("context server %s answered %s to %s", url, response.status_code, ENDPOINT_PATH)
            return None
        return endpoint
