"""The router's side of the dashboard: /health bodies read into status, epoch and restarts; the
health monitor's round hook; the page, its assets and its JSON feed served by the router app."""

from __future__ import annotations

import asyncio
import json
import re

from deploy_harness import free_port
from starlette.testclient import TestClient
from waiting import wait_until_async

from server.config.router import RouterConfig
from server.router.app import create_router_app
from server.router.backends import Backend, HealthMonitor
from server.router.http_client import HttpClient, Response


def health(status: int, body: object) -> Response:
    return Response(status, body if isinstance(body, bytes) else json.dumps(body).encode())


def test_a_changed_epoch_counts_a_restart():
    backend = Backend("http://s", "generation")
    backend.note_health(health(200, {"status": "ok", "epoch": "a"}))
    assert (backend.status, backend.epoch, backend.restarts) == ("ok", "a", 0)  # first sight: no restart
    backend.note_health(health(200, {"status": "ok", "epoch": "a"}))
    assert backend.restarts == 0
    backend.note_health(None)  # down for a while: the epoch is kept
    assert (backend.status, backend.epoch, backend.restarts) == ("unreachable", "a", 0)
    backend.note_health(health(200, {"status": "ok", "epoch": "b"}))
    backend.note_health(health(200, {"status": "ok", "epoch": "c"}))
    assert (backend.status, backend.epoch, backend.restarts) == ("ok", "c", 2)


def test_status_comes_from_the_body_or_the_http_code():
    backend = Backend("http://s", "context")
    backend.note_health(health(503, {"status": "draining", "epoch": "a"}))
    assert (backend.status, backend.epoch) == ("draining", "a")
    backend.note_health(health(503, {"error": {"message": "the engine is not ready yet", "code": "not_ready"}}))
    assert (backend.status, backend.epoch) == ("HTTP 503", "a")
    backend.note_health(health(502, b"<html>bad gateway</html>"))
    assert backend.status == "HTTP 502"
    backend.note_health(health(200, ["not", "an", "object"]))
    assert (backend.status, backend.restarts) == ("HTTP 200", 0)


def test_a_failing_round_hook_does_not_stop_the_health_checks():
    async def scenario() -> list[int]:
        client = HttpClient()
        monitor = HealthMonitor([], client, interval_s=0.01)
        rounds: list[int] = []

        async def hook() -> None:
            rounds.append(len(rounds))
            if len(rounds) == 1:
                raise RuntimeError("scrape exploded")

        monitor.on_round = hook
        monitor.start()
        await wait_until_async(lambda: len(rounds) >= 3, 5, "3 health rounds")
        await monitor.stop()
        await client.aclose()
        return rounds

    assert asyncio.run(scenario())[:3] == [0, 1, 2]


def dead_port() -> int:
    return free_port()  # free, below the ephemeral range: nothing listens there


def test_router_serves_the_page_its_assets_and_the_feed():
    ctx, gen = f"127.0.0.1:{dead_port()}", f"127.0.0.1:{dead_port()}"
    app = create_router_app(RouterConfig(context_urls=(ctx,), generation_urls=(gen,), health_interval_s=0.05))
    with TestClient(app) as client:
        page = client.get("/dashboard")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assets = re.findall(r'(?:src|href)="(/dashboard/static/[^"]+)"', page.text)
        assert sorted(assets) == ["/dashboard/static/dashboard.css", "/dashboard/static/dashboard.js"]
        assert "http" not in re.sub(r'xmlns="[^"]*"', "", page.text)  # nothing loaded from elsewhere
        for asset, kind in zip(sorted(assets), ("text/css", "text/javascript"), strict=True):
            response = client.get(asset)
            assert response.status_code == 200 and response.headers["content-type"].startswith(kind)
            assert "http" not in response.text
        state = client.get("/dashboard/state")
        assert state.headers["cache-control"] == "no-store"
        body = state.json()
    assert [(s["url"], s["role"], s["healthy"], s["status"], s["stale"]) for s in body["servers"]] == [
        (f"http://{ctx}", "context", False, "unreachable", True),
        (f"http://{gen}", "generation", False, "unreachable", True)]
    assert "ConnectError" in body["servers"][0]["last_error"]
    assert (body["deployment"]["healthy"], body["deployment"]["servers"], body["deployment"]["requests"]) == (0, 2, 0)
    assert body["deployment"]["ttft"] == {"p50": None, "p90": None, "p99": None, "count": 0}
