"""GET /dashboard (the page), GET /dashboard/state (its JSON feed), /dashboard/static/* (its script
and style, shipped in this package: the page needs nothing from the internet)."""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from server.openai.wire import JSONBody

STATIC = Path(__file__).parent / "static"
NO_STORE = {"Cache-Control": "no-store"}


def dashboard_routes() -> list[BaseRoute]:
    return [Route("/dashboard", _page, methods=["GET"]),
            Route("/dashboard/state", _state, methods=["GET"]),
            Mount("/dashboard/static", StaticFiles(directory=STATIC), name="dashboard-static")]


async def _page(request: Request) -> Response:
    return FileResponse(STATIC / "index.html", media_type="text/html; charset=utf-8")


async def _state(request: Request) -> Response:
    return JSONBody(request.app.state.router.dashboard.state(), headers=NO_STORE)
