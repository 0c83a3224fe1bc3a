"""The generation server's directory of context servers' KV endpoints (server/api/context_directory.py)
against a real HTTP server on loopback: it learns each endpoint with the deployment token, and every
refresh goes through one kept-alive client (a client per refresh cost an SSL context, ~25 ms of the
server's event loop every `interval_s`: docs/DISAGG_LOAD.md)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from server.api.context_directory import ENDPOINT_PATH, ContextDirectory
from server.auth import token_headers

TOKEN = "unit-directory-token-0123456789"
ENDPOINT = "tcp://127.0.0.1:5999"


class _ContextServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.connections = 0
        self.requests = 0
        self.endpoint = ENDPOINT

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: one connection serves many requests
    server: _ContextServer

    def setup(self) -> None:
        super().setup()
        self.server.connections += 1

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.server.requests += 1
        expected = token_headers(TOKEN)
        authorised = all(self.headers.get(k) == v for k, v in expected.items())
        ok = self.path == ENDPOINT_PATH and authorised
        body = json.dumps({"endpoint": self.server.endpoint} if ok else {"error": "no"}).encode()
        self.send_response(200 if ok else 401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        return None


@pytest.fixture
def context_server() -> Iterator[_ContextServer]:
    server = _ContextServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(5)


def test_refreshes_learn_the_endpoint_over_one_kept_alive_client(context_server: _ContextServer) -> None:
    async def scenario() -> tuple[bool, bool]:
        directory = ContextDirectory([context_server.url], TOKEN, min_refresh_s=0.0)
        try:
            for _ in range(4):
                await directory.refresh()
            return await directory.knows(ENDPOINT), await directory.knows("tcp://127.0.0.1:1")
        finally:
            await directory.stop()

    known, foreign = asyncio.run(scenario())
    assert known and not foreign
    assert context_server.requests == 5  # 4 refreshes, and one more for the unknown endpoint
    assert context_server.connections == 1


def test_stop_closes_the_client_and_a_later_refresh_opens_another(context_server: _ContextServer) -> None:
    async def scenario() -> None:
        directory = ContextDirectory([context_server.url], TOKEN)
        await directory.refresh()
        await directory.stop()
        await directory.refresh()
        await directory.stop()

    asyncio.run(scenario())
    assert context_server.requests == 2 and context_server.connections == 2


def test_an_endpoint_that_appears_during_a_refresh_is_learned_by_the_call_that_waited_for_it(
        context_server: _ContextServer) -> None:
    """A context server restarts on a new endpoint while the directory's lock is held (a refresh
    under way, begun before the restart): the call that waited asks again, although the last
    refresh is younger than `min_refresh_s` (such a call used to be refused)."""
    new = "tcp://127.0.0.1:6000"

    async def scenario() -> tuple[bool, bool, int]:
        directory = ContextDirectory([context_server.url], TOKEN, min_refresh_s=60.0)
        try:
            await directory.refresh()
            async with directory._lock:  # the refresh under way
                waiting = asyncio.ensure_future(directory.knows(new))
                await asyncio.sleep(0.05)
                context_server.endpoint = new  # the restart
            return await waiting, await directory.knows(ENDPOINT), context_server.requests
        finally:
            await directory.stop()

    knows_new, knows_old, requests = asyncio.run(scenario())
    assert knows_new and not knows_old  # the old endpoint is gone from the directory: refused
    assert requests == 3  # the first refresh, the waiting call's, the old endpoint's
