"""The dashboard's feed: the router scrapes every server's /metrics on the health monitor's interval
and keeps one minute of samples per server (and of its own counters); `state()` is the page's JSON,
served with the page by `dashboard_routes`."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from server.auth import token_headers
from server.dashboard.views import deployment_view, server_view
from server.dashboard.window import Window, parse_metrics
from server.openai.wire import JSONBody
from server.router.backends import Backend
from server.router.http_client import HttpClient, HttpError

log = logging.getLogger(__name__)

SCRAPE_TIMEOUT_S = 1.0
STATIC = Path(__file__).parent / "static"


class Dashboard:
    def __init__(self, backends: list[Backend], client: HttpClient, router_registry: CollectorRegistry,
                 auth_token: str | None = None) -> None:
        self.backends = backends
        self.client = client
        self.router_registry = router_registry
        self.headers = token_headers(auth_token)  # the deployment token, as on every internal call
        self.windows = {b.url: Window() for b in backends}
        self.router = Window()

    async def scrape_all(self) -> None:
        """One round: the router's own counters, and /metrics of every server that passes health."""
        self.router.add(parse_metrics(generate_latest(self.router_registry).decode(), time.monotonic()))
        await asyncio.gather(*(self._scrape(b) for b in self.backends if b.healthy))

    async def _scrape(self, backend: Backend) -> None:
        try:
            response = await self.client.request("GET", f"{backend.url}/metrics", headers=self.headers,
                                                 timeout=SCRAPE_TIMEOUT_S)
            if response.status != 200:
                raise ValueError(f"/metrics returned {response.status}")
            sample = parse_metrics(response.content.decode(), time.monotonic())
        except (HttpError, ValueError) as exc:  # UnicodeDecodeError is a ValueError
            log.debug("could not scrape %s: %s", backend.url, exc)
            return
        self.windows[backend.url].add(sample)

    def state(self) -> dict:
        now = time.monotonic()
        servers = [server_view(b, self.windows[b.url], now) for b in self.backends]
        return {"deployment": deployment_view(self.backends, self.windows, self.router, now), "servers": servers}


def dashboard_routes() -> list[BaseRoute]:
    """GET /dashboard (the page), GET /dashboard/state (its JSON) and /dashboard/static/* (its script and
    style, shipped in this package: the page needs nothing from the internet)."""
    return [Route("/dashboard", _page, methods=["GET"]),
            Route("/dashboard/state", _state, methods=["GET"]),
            Mount("/dashboard/static", StaticFiles(directory=STATIC), name="dashboard-static")]


async def _page(request: Request) -> Response:
    return FileResponse(STATIC / "index.html", media_type="text/html; charset=utf-8")


async def _state(request: Request) -> Response:
    return JSONBody(request.app.state.router.dashboard.state(), headers={"Cache-Control": "no-store"})
