"""The router queue with a real router app (uvicorn on loopback) in front of a stand-in server that
answers only when the test lets it: with every server saturated a request waits; a full queue and a
wait past the timeout are 503s that say which (and are counted); the queue's depth and wait times are
in /metrics; no leg stays booked once its request ended, however it ended."""

from __future__ import annotations

import asyncio
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from waiting import wait_until

from server.config.router import QueueLimits, RouterConfig
from server.router.app import create_router_app

TOKEN = "a-deployment-token-of-enough-length"
WAIT_S = 20.0


class _Served:
    """Runs an ASGI app with uvicorn on a free loopback port in a thread."""

    def __init__(self, app) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.url = f"127.0.0.1:{self.sock.getsockname()[1]}"

    def __enter__(self):
        self.thread.start()
        wait_until(lambda: self.server.started, WAIT_S, "server started")
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(20)
        self.sock.close()


class GatedServer(_Served):
    """An aggregated server stand-in: each completion waits for one `gate.release()`."""

    def __init__(self) -> None:
        self.gate = threading.Semaphore(0)
        self.arrived = 0

        async def completions(request: Request) -> JSONResponse:
            self.arrived += 1
            if not await asyncio.to_thread(self.gate.acquire, True, 30):
                return JSONResponse({"error": {"message": "gate never opened"}}, 500)
            return JSONResponse({"id": "x", "object": "text_completion", "choices": [{"text": "!"}]})

        super().__init__(Starlette(routes=[Route("/health", lambda r: JSONResponse({"status": "ok"})),
                                           Route("/v1/completions", completions, methods=["POST"])]))


def metric(url: str, name: str, labels: str = "") -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    pattern = re.compile(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", re.M)
    return sum(float(v) for lab, v in pattern.findall(text) if labels in (lab or ""))


def active(url: str) -> int:
    [server] = httpx.get(f"{url}/health", timeout=10).json()["servers"].values()
    return server["active"]


def test_saturated_servers_queue_requests_and_only_a_full_queue_or_a_timeout_is_a_503():
    limits = QueueLimits(max_inflight_per_server=1, max_waiting=1, timeout_s=3.0)
    with GatedServer() as backend:
        settings = RouterConfig(generation_urls=(backend.url,), health_interval_s=60, auth_token=TOKEN,
                                queue=limits)
        with _Served(create_router_app(settings)) as router, ThreadPoolExecutor(4) as pool:
            url = f"http://{router.url}"

            def post():
                return httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=60)

            first = pool.submit(post)
            wait_until(lambda: backend.arrived == 1, WAIT_S, "the first request reached the server")
            second = pool.submit(post)
            wait_until(lambda: metric(url, "pdserve_router_queue_depth", 'leg="generation"') == 1, WAIT_S, "queued")
            full = post()
            assert full.status_code == 503
            error = full.json()["error"]
            assert error["code"] == "router_queue_full" and "the router queue is full" in error["message"]
            assert "saturated (1 legs in flight each)" in error["message"]
            backend.gate.release()
            assert first.result().status_code == 200
            wait_until(lambda: backend.arrived == 2, WAIT_S, "the queued request went on when the first ended")
            backend.gate.release()
            assert second.result().status_code == 200

            third = pool.submit(post)
            wait_until(lambda: backend.arrived == 3, WAIT_S, "the third request reached the server")
            started = time.monotonic()
            late = post()  # waits its 3 s in the queue: the server stays busy
            assert late.status_code == 503 and time.monotonic() - started >= 3.0
            error = late.json()["error"]
            assert error["code"] == "router_queue_timeout" and "waited 3 s in the router queue" in error["message"]
            backend.gate.release()
            assert third.result().status_code == 200

            assert metric(url, "pdserve_router_queue_rejected_total", 'reason="full"') == 1
            assert metric(url, "pdserve_router_queue_rejected_total", 'reason="timeout"') == 1
            assert metric(url, "pdserve_router_queue_wait_seconds_count", 'leg="generation"') == 2
            assert metric(url, "pdserve_router_queue_wait_seconds_sum", 'leg="generation"') >= 3.0
            assert metric(url, "pdserve_router_queue_depth") == 0
            assert active(url) == 0 and backend.arrived == 3  # the refused requests never reached it


def test_a_client_that_leaves_ends_its_legs_booking():
    limits = QueueLimits(max_inflight_per_server=1, max_waiting=4, timeout_s=30.0)
    with GatedServer() as backend:
        settings = RouterConfig(generation_urls=(backend.url,), health_interval_s=60, auth_token=TOKEN,
                                queue=limits)
        with _Served(create_router_app(settings)) as router:
            url = f"http://{router.url}"
            for stream in (False, True):
                try:
                    httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "stream": stream}, timeout=1.0)
                except httpx.TimeoutException:
                    pass
                wait_until(lambda: active(url) == 0, WAIT_S, f"the booking ended (stream={stream})")
                backend.gate.release()  # let the abandoned request on the server end
            # the server is free again for the next request: nothing stayed booked
            backend.gate.release()
            assert httpx.post(f"{url}/v1/completions", json={"prompt": "hi"}, timeout=30).status_code == 200


def test_bookings_count_what_each_leg_loads_its_server_with():
    from prometheus_client import CollectorRegistry

    from kvcache import block_hashes
    from server.router.backends import Backend
    from server.router.policies import KvCacheAware, Prompt
    from server.router.queue import LegPicker, QueueMetrics

    tokens = list(range(100, 200))  # 100 tokens: 3 full blocks of 32
    server = Backend("http://127.0.0.1:1", "context", healthy=True)
    server.kv_index.reset({"salt": "fp", "tokens_per_block": 32, "windows": {"2048": {
        "primary": [h.hex() for h in block_hashes(tokens[:64], 32, "fp")], "secondary": []}}})
    metrics = QueueMetrics(CollectorRegistry())
    context = LegPicker("context", KvCacheAware(), QueueLimits(), metrics)
    generation = LegPicker("generation", KvCacheAware(), QueueLimits(), metrics, decodes=True)
    prompt = Prompt(lambda: tokens, max_tokens=20)
    prefill = context.book([server], prompt, set())  # 100 - 64 cached: 36 tokens to prefill
    decode = generation.book([server], prompt, set())  # the whole context it decodes with: 100 + 20
    assert (prefill.tokens, decode.tokens, server.active, server.load_tokens) == (36, 120, 2, 156)
    prefill.done()
    prefill.done()  # idempotent
    assert (server.active, server.load_tokens) == (1, 120)
    decode.done()
    assert (server.active, server.load_tokens) == (0, 0)
