"""The router's HTTP/1.1 client: keep-alive connections per backend, responses parsed by httptools.

The router's legs are plain HTTP/1.1 exchanges with servers of this project on a trusted network:
one POST with a JSON body, answered with JSON or with an SSE stream. A profile of the router in
front of backends that answer at once put about 70% of its CPU per request in httpx (its request
model, connection pool and h11 state machine); this client does the same exchange in a fraction of
that (scripts/bench_router.py), which is time on every request's way to its first token.

Connections: one request at a time each; kept for reuse when a response ends with keep-alive, and
dropped when they sat idle for `max_idle_s` (below uvicorn's 5 s keep-alive timeout, so the server
rarely closes one under us). When a reused connection dies before any byte of the answer arrives
(the server closed it as the request went out), the request is sent once more on a new connection.

Timeouts: connecting within `connect_timeout_s`; the status line and headers within the call's
`timeout`; then each piece of a streamed body within `timeout` again (`request` bounds the whole
exchange). A streamed body that the reader does not keep up with pauses the socket once
`MAX_BUFFERED` bytes wait, so a slow client cannot make the router buffer a whole answer.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import httptools
import msgspec

MAX_BUFFERED = 256 << 10  # bytes of a streamed body waiting for its reader before the socket pauses
MAX_IDLE_PER_HOST = 64


class HttpError(Exception):
    """The exchange failed below HTTP: there is no (complete) response."""


class ConnectError(HttpError):
    """The server could not be reached (refused, unreachable, or too slow to accept)."""


class ReadError(HttpError):
    """The connection broke, or the answer was not valid HTTP, before the response ended."""


class RequestTimeout(HttpError):
    """No status line, or no next piece of the body, within the timeout."""


@dataclass
class Response:
    status: int
    content: bytes

    def json(self) -> object:
        """The body as JSON; ValueError if it is not JSON."""
        return msgspec.json.decode(self.content)


class StreamResponse:
    """A response whose body is read as it arrives. `aclose` ends it; a connection whose body was
    not read to its end is closed, not reused."""

    def __init__(self, status: int, chunks: AsyncIterator[bytes],
                 close: Callable[[], Awaitable[None]] | None = None) -> None:
        self.status = status
        self._chunks = chunks
        self._close = close

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        async for chunk in self._chunks:
            yield chunk

    async def aread(self) -> bytes:
        return b"".join([chunk async for chunk in self._chunks])

    async def aclose(self) -> None:
        """Idempotent."""
        close, self._close = self._close, None
        if close is not None:
            await close()


class _Exchange:
    """One response as it arrives on a connection: status, then body pieces, then the end."""

    def __init__(self, conn: _Connection) -> None:
        self.conn = conn
        self.status = 0
        self.headers_seen: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.ended = False
        self.error: HttpError | None = None
        self.got_bytes = False
        self._waiter: asyncio.Future[None] | None = None

    def wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def fail(self, error: HttpError) -> None:
        if self.ended or self.error is not None:
            return
        self.error = error
        if not self.headers_seen.done():
            self.headers_seen.set_exception(error)
            self.headers_seen.exception()  # retrieved here: a caller may have stopped waiting
        self.wake()

    async def next_chunk(self, timeout: float | None) -> bytes | None:
        """The next piece of the body, or None at its end."""
        while not self.chunks:
            if self.error is not None:
                raise self.error
            if self.ended:
                return None
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                async with asyncio.timeout(timeout):
                    await self._waiter
            except TimeoutError:
                raise RequestTimeout(f"no data from the server within {timeout} s") from None
            finally:
                self._waiter = None
        chunk = self.chunks.popleft()
        self.buffered -= len(chunk)
        if self.buffered < MAX_BUFFERED // 2:
            self.conn.resume()
        return chunk


class _Connection(asyncio.Protocol):
    """One TCP connection to a backend; httptools calls the `on_*` methods while it parses."""

    def __init__(self, on_reusable: Callable[[_Connection], None]) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.exchange: _Exchange | None = None
        self.closed = False
        self.idle_since = 0.0
        self._paused = False
        self._on_reusable = on_reusable

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.exchange is None:  # nothing was asked: a broken or confused server
            self.close()
            return
        self.exchange.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(ReadError(f"invalid HTTP response: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.exchange is not None:  # (bodies delimited by the connection's end are not supported)
            self.exchange.fail(ReadError("the server closed the connection before the response ended"))

    # httptools callbacks
    def on_headers_complete(self) -> None:
        exchange = self.exchange
        exchange.status = self.parser.get_status_code()
        if not exchange.headers_seen.done():  # done: the caller stopped waiting (timeout, cancel)
            exchange.headers_seen.set_result(None)

    def on_body(self, body: bytes) -> None:
        exchange = self.exchange
        exchange.chunks.append(body)
        exchange.buffered += len(body)
        if exchange.buffered > MAX_BUFFERED and not self._paused:
            self._paused = True
            self.transport.pause_reading()
        exchange.wake()

    def on_message_complete(self) -> None:
        exchange, self.exchange = self.exchange, None
        exchange.ended = True
        exchange.wake()
        if self.parser.should_keep_alive() and not self.closed:
            self.resume()  # the body may have paused reading; the next exchange must not start paused
            self.idle_since = time.monotonic()
            self._on_reusable(self)
        else:
            self.close()

    # used by the client
    def send(self, request: bytes) -> _Exchange:
        self.exchange = _Exchange(self)
        self.transport.write(request)
        return self.exchange

    def resume(self) -> None:
        if self._paused and not self.closed:
            self._paused = False
            self.transport.resume_reading()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def _fail(self, error: HttpError) -> None:
        if self.exchange is not None:
            self.exchange.fail(error)
        self.close()


class HttpClient:
    """Keep-alive HTTP/1.1 to the router's backends (`http://host:port` URLs only)."""

    def __init__(self, connect_timeout_s: float = 5.0, max_idle_s: float = 2.0) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.max_idle_s = max_idle_s
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._all: set[_Connection] = set()

    async def request(self, method: str, url: str, *, json: object = None, headers: dict[str, str] | None = None,
                      timeout: float | None = None) -> Response:
        """The whole exchange, bounded by `timeout` as a whole."""
        try:
            async with asyncio.timeout(timeout):
                stream = await self.stream(method, url, json=json, headers=headers, timeout=None)
                try:
                    return Response(stream.status, await stream.aread())
                finally:
                    await stream.aclose()
        except TimeoutError:
            raise RequestTimeout(f"{method} {url}: no complete response within {timeout} s") from None

    async def stream(self, method: str, url: str, *, json: object = None, headers: dict[str, str] | None = None,
                     timeout: float | None = None) -> StreamResponse:
        """Send the request; return once the status line and headers are in."""
        host, port, target = _split(url)
        payload = _request_bytes(method, host, port, target, json, headers)
        for attempt in range(2):
            conn = None if attempt else self._take_idle((host, port))
            reused = conn is not None
            conn = conn or await self._connect(host, port)
            try:
                exchange = conn.send(payload)
                try:
                    async with asyncio.timeout(timeout):
                        await exchange.headers_seen
                except TimeoutError:
                    raise RequestTimeout(f"{method} {url}: no response within {timeout} s") from None
            except ReadError:
                conn.close()
                if reused and not exchange.got_bytes:
                    continue  # the server dropped an idle connection as we used it: once more, anew
                raise
            except BaseException:
                conn.close()
                raise
            return StreamResponse(exchange.status, _body(exchange, timeout), _closer(exchange))
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        for conn in list(self._all):
            conn.close()
        self._all.clear()
        self._idle.clear()

    def _take_idle(self, key: tuple[str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.closed and not conn.transport.is_closing() and now - conn.idle_since < self.max_idle_s:
                return conn
            self._forget(conn)
        return None

    async def _connect(self, host: str, port: int) -> _Connection:
        loop = asyncio.get_running_loop()
        key = (host, port)
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(lambda: _Connection(self._reusable(key)), host, port)
        except TimeoutError:
            raise ConnectError(f"connecting to {host}:{port} timed out after {self.connect_timeout_s} s") from None
        except OSError as exc:
            raise ConnectError(f"cannot connect to {host}:{port}: {exc.strerror or exc}") from exc
        self._all.add(conn)
        return conn

    def _reusable(self, key: tuple[str, int]) -> Callable[[_Connection], None]:
        def give_back(conn: _Connection) -> None:
            idle = self._idle.setdefault(key, [])
            if len(idle) < MAX_IDLE_PER_HOST:
                idle.append(conn)
            else:
                self._forget(conn)
        return give_back

    def _forget(self, conn: _Connection) -> None:
        conn.close()
        self._all.discard(conn)


async def _body(exchange: _Exchange, timeout: float | None) -> AsyncIterator[bytes]:
    while (chunk := await exchange.next_chunk(timeout)) is not None:
        yield chunk


def _closer(exchange: _Exchange) -> Callable[[], Awaitable[None]]:
    async def close() -> None:
        if not exchange.ended:  # unread body or broken exchange: the connection cannot be reused
            exchange.conn.exchange = None
            exchange.conn.close()
    return close


def _split(url: str) -> tuple[str, int, str]:
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"only http://host:port URLs are supported, got {url!r}")
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return parts.hostname, parts.port or 80, target


def _request_bytes(method: str, host: str, port: int, target: str, body: object,
                   headers: dict[str, str] | None) -> bytes:
    lines = [f"{method} {target} HTTP/1.1", f"Host: {host}:{port}"]
    content = b""
    if body is not None:
        content = msgspec.json.encode(body)
        lines.append("Content-Type: application/json")
    if body is not None or method in ("POST", "PUT", "PATCH"):
        lines.append(f"Content-Length: {len(content)}")
    for name, value in (headers or {}).items():
        if any(c in f"{name}{value}" for c in "\r\n"):
            raise ValueError(f"header {name!r} contains a line break")
        lines.append(f"{name}: {value}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + content
