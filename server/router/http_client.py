"""The router's HTTP client for its servers: aiohttp's, behind the three calls the router makes.

Idle connections are dropped after `keepalive_s`, below uvicorn's 5 s keep-alive, so a server
rarely closes one under us. A streamed body its reader does not keep up with pauses the socket,
so a slow client cannot make the router buffer a whole answer. Failures below HTTP are one of
`ConnectError` (not reached), `ReadError` (the exchange broke) and `RequestTimeout`."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import aiohttp

from server.openai.wire import dumps, loads

KEEPALIVE_S = 2.0
CONNECT_TIMEOUT_S = 5.0
JSON_HEADERS = {"Content-Type": "application/json"}


class HttpError(Exception):
    """The exchange failed below HTTP: there is no (complete) response."""


class ConnectError(HttpError):
    """The server could not be reached (refused, unreachable, or too slow to accept)."""


class ReadError(HttpError):
    """The connection broke, or the answer was not valid HTTP, before the response ended."""


class RequestTimeout(HttpError):
    """No answer, or no next piece of the body, within the timeout."""


@contextmanager
def _failures(what: str) -> Iterator[None]:
    """aiohttp's exceptions as the three above."""
    try:
        yield
    except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
        raise ConnectError(f"{what}: {exc}") from exc
    except TimeoutError as exc:  # aiohttp's socket and total timeouts are TimeoutErrors
        raise RequestTimeout(f"{what}: no answer in time") from exc
    except aiohttp.ClientError as exc:
        raise ReadError(f"{what}: {type(exc).__name__}: {exc}") from exc


@dataclass
class Response:
    status: int
    content: bytes

    def json(self) -> object:
        """The body as JSON; ValueError if it is not JSON."""
        return loads(self.content)


class StreamResponse:
    """A response read as it arrives; `aclose` ends it (a body not read to its end closes the connection)."""

    def __init__(self, status: int, chunks: AsyncIterator[bytes],
                 close: Callable[[], Awaitable[None]] | None = None, content_type: str = "") -> None:
        self.status = status
        self.content_type = content_type  # the media type, without parameters
        self._chunks = chunks
        self._close = close

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        async for chunk in self._chunks:
            yield chunk

    async def whole(self) -> Response:
        """The rest of the body as one Response; the stream is closed either way."""
        try:
            return Response(self.status, b"".join([chunk async for chunk in self._chunks]))
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        """Idempotent."""
        close, self._close = self._close, None
        if close is not None:
            await close()


class HttpClient:
    """Keep-alive HTTP/1.1 to the router's backends. The session opens on first use (in the loop)."""

    def __init__(self, keepalive_s: float = KEEPALIVE_S) -> None:
        self.keepalive_s = keepalive_s
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=self.keepalive_s)
            self._session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        return self._session

    def _timeout(self, total: float | None, read: float | None) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=total, sock_connect=CONNECT_TIMEOUT_S, sock_read=read)

    async def request(self, method: str, url: str, *, json: object = None, headers: dict[str, str] | None = None,
                      timeout: float | None = None) -> Response:
        """The whole exchange, bounded by `timeout` as a whole."""
        data, headers = _body(json, headers)
        with _failures(f"{method} {url}"):
            async with self.session.request(method, url, data=data, headers=headers,
                                            timeout=self._timeout(timeout, None)) as response:
                return Response(response.status, await response.read())

    async def stream(self, method: str, url: str, *, json: object = None, headers: dict[str, str] | None = None,
                     timeout: float | None = None) -> StreamResponse:
        """Send the request; return once the status line and headers are in."""
        data, headers = _body(json, headers)
        what = f"{method} {url}"
        with _failures(what):
            response = await self.session.request(method, url, data=data, headers=headers,
                                                  timeout=self._timeout(None, timeout))

        async def chunks() -> AsyncIterator[bytes]:
            with _failures(what):
                async for chunk in response.content.iter_any():
                    yield chunk

        async def close() -> None:
            response.release()  # back to the pool if the body was read to its end, else closed

        return StreamResponse(response.status, chunks(), close, response.content_type)

    async def aclose(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()


def _body(value: object, headers: dict[str, str] | None) -> tuple[bytes | None, dict[str, str] | None]:
    if value is None:
        return None, headers
    return dumps(value), {**JSON_HEADERS, **(headers or {})}
