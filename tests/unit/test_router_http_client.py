"""The router's HTTP client (aiohttp behind server/router/http_client.py) against real loopback servers
that misbehave on purpose: reuse, streaming, timeouts, and which error each failure is."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

import pytest

from server.router.http_client import ConnectError, HttpClient, ReadError, RequestTimeout

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, dict], Awaitable[None]]


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, bytes] | None:
    """(request line, body) of the next request on the connection; None at its end."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    lines = head.decode().split("\r\n")
    length = next((int(line.split(":")[1]) for line in lines if line.lower().startswith("content-length")), 0)
    return lines[0], await reader.readexactly(length)


def _json_reply(payload: object, close: bool = False) -> bytes:
    body = json.dumps(payload).encode()
    extra = "Connection: close\r\n" if close else ""
    return (f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
            .encode() + body)


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


async def _open_chunked(reader, writer, first: bytes) -> None:
    """Read the request; answer 200 with a chunked body, its first chunk `first` sent."""
    await _read_request(reader)
    writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + _chunk(first))
    await writer.drain()


class Server:
    """A loopback server; `handler` serves each connection. Counts connections."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.shared: dict = {}

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc) -> None:
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer, self.shared)
        finally:
            writer.close()


async def _echo(reader, writer, shared) -> None:
    while (request := await _read_request(reader)) is not None:
        line, body = request
        writer.write(_json_reply({"line": line, "body": json.loads(body) if body else None}))
        await writer.drain()


def run(coro):
    return asyncio.run(coro)


def test_json_exchanges_reuse_one_connection():
    async def main():
        server = Server(_echo)
        async with server as url:
            client = HttpClient()
            replies = [await client.request("POST", f"{url}/v1/x?a=1", json={"n": i, "s": "é"}, timeout=5)
                       for i in range(3)]
            get = await client.request("GET", f"{url}/health", timeout=5)
            await client.aclose()
        assert [r.status for r in replies] == [200, 200, 200]
        assert [r.json()["body"] for r in replies] == [{"n": i, "s": "é"} for i in range(3)]
        assert replies[0].json()["line"] == "POST /v1/x?a=1 HTTP/1.1"
        assert get.json() == {"line": "GET /health HTTP/1.1", "body": None}
        assert server.connections == 1
    run(main())


def test_a_chunked_stream_arrives_piece_by_piece():
    async def handler(reader, writer, shared):
        await _open_chunked(reader, writer, b"data: 1\n\n")
        await shared["next"].wait()  # the second piece only after the client has the first
        writer.write(_chunk(b"data: 2\n\n") + b"0\r\n\r\n")
        await writer.drain()
        await _read_request(reader)

    async def main():
        server = Server(handler)
        server.shared["next"] = asyncio.Event()
        async with server as url:
            client = HttpClient()
            response = await client.stream("POST", f"{url}/s", json={}, timeout=5)
            pieces = response.aiter_raw()
            first = await anext(pieces)
            server.shared["next"].set()
            rest = [piece async for piece in pieces]
            await response.aclose()
            await client.aclose()
        assert response.status == 200 and first == b"data: 1\n\n" and rest == [b"data: 2\n\n"]
    run(main())


def test_connection_close_and_an_idle_connection_dropped_by_the_server_cost_nothing():
    async def handler(reader, writer, shared):  # answers once, then closes (with or without saying so)
        await _read_request(reader)
        writer.write(_json_reply({"ok": True}, close=shared.setdefault("n", 0) % 2 == 0))
        shared["n"] += 1
        await writer.drain()

    async def main():
        server = Server(handler)
        async with server as url:
            client = HttpClient()
            for _ in range(4):
                assert (await client.request("POST", url, json={}, timeout=5)).json() == {"ok": True}
                await asyncio.sleep(0.05)
            await client.aclose()
        assert server.connections == 4
    run(main())


def test_connections_idle_longer_than_keepalive_are_not_reused():
    async def main():
        server = Server(_echo)
        async with server as url:
            client = HttpClient(keepalive_s=0.05)
            await client.request("GET", url, timeout=5)
            await asyncio.sleep(0.1)
            await client.request("GET", url, timeout=5)
            await client.request("GET", url, timeout=5)
            await client.aclose()
        assert server.connections == 2
    run(main())


def test_a_refused_connection_is_a_connect_error():
    async def main():
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        client = HttpClient()
        with pytest.raises(ConnectError, match=f"127.0.0.1:{port}"):
            await client.request("GET", f"http://127.0.0.1:{port}/health", timeout=5)
        await client.aclose()
    run(main())


def test_no_answer_in_time_is_a_timeout_and_the_connection_is_dropped():
    async def handler(reader, writer, shared):
        await _read_request(reader)
        shared["eof"] = await reader.read() == b""  # the client hangs up after its timeout

    async def main():
        server = Server(handler)
        async with server as url:
            client = HttpClient()
            with pytest.raises(RequestTimeout):
                await client.request("POST", url, json={}, timeout=0.1)
            with pytest.raises(RequestTimeout):
                await client.stream("POST", url, json={}, timeout=0.1)
            await asyncio.sleep(0.05)
            await client.aclose()
        assert server.shared["eof"] is True
    run(main())


def test_a_silent_stream_times_out_between_pieces():
    async def handler(reader, writer, shared):
        await _open_chunked(reader, writer, b"one")
        await reader.read()

    async def main():
        async with Server(handler) as url:
            client = HttpClient()
            response = await client.stream("POST", url, json={}, timeout=0.2)
            pieces = response.aiter_raw()
            assert await anext(pieces) == b"one"
            with pytest.raises(RequestTimeout):
                await anext(pieces)
            await response.aclose()
            await client.aclose()
    run(main())


@pytest.mark.parametrize("reply", [b"garbage\r\n\r\n", b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc"])
def test_an_invalid_or_cut_answer_is_a_read_error(reply):
    async def handler(reader, writer, shared):
        await _read_request(reader)
        writer.write(reply)
        await writer.drain()

    async def main():
        async with Server(handler) as url:
            client = HttpClient()
            with pytest.raises(ReadError):
                await client.request("POST", url, json={}, timeout=5)
            await client.aclose()
    run(main())


def test_a_stream_closed_early_closes_its_connection():
    async def handler(reader, writer, shared):
        await _open_chunked(reader, writer, b"one")
        shared["eof"] = await reader.read() == b""

    async def main():
        server = Server(handler)
        async with server as url:
            client = HttpClient()
            response = await client.stream("POST", url, json={}, timeout=5)
            assert await anext(response.aiter_raw()) == b"one"
            await response.aclose()
            await response.aclose()  # idempotent
            await asyncio.sleep(0.05)
            await client.aclose()
        assert server.shared["eof"] is True
    run(main())


def test_more_legs_than_aiohttps_default_limit_run_at_once_on_one_server():
    """aiohttp's connector allows 100 connections unless told otherwise; the router's has no limit,
    so c=160 streams to one generation server are 160 exchanges in flight, not 100 and a queue."""
    count = 160

    async def hold_until_all_arrived(reader, writer, shared) -> None:
        while await _read_request(reader) is not None:
            shared["arrived"] = shared.get("arrived", 0) + 1
            if shared["arrived"] == count:
                shared["all"].set()
            await asyncio.wait_for(shared["all"].wait(), 10)  # a capped pool never gets here: timeout
            writer.write(_json_reply({"in_flight": shared["arrived"]}))
            await writer.drain()

    async def main():
        server = Server(hold_until_all_arrived)
        server.shared["all"] = asyncio.Event()
        async with server as url:
            client = HttpClient()
            replies = await asyncio.gather(*(client.request("POST", f"{url}/v1/x", json={}, timeout=15)
                                             for _ in range(count)))
            await client.aclose()
        assert [r.json()["in_flight"] for r in replies] == [count] * count
        assert server.connections == count
    run(main())
