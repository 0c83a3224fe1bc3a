"""Server-sent events, for the servers and the router: framing, the one SSE response, and running
work only while the client is still there.

U+0085, U+2028 and U+2029 are escaped in events: clients that split a stream with
`str.splitlines()` (httpx's `aiter_lines()`) would cut the event in two. Client disconnects are
watched actively (`http.disconnect`), so work for a client that left stops at once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import anyio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from server.openai.wire import dumps

T = TypeVar("T")
LINE_BREAKS = "\u0085\u2028\u2029"
_ESCAPE = str.maketrans({ch: f"\\u{ord(ch):04x}" for ch in LINE_BREAKS})
DONE = b"data: [DONE]\n\n"


def escape_line_breaks(data: str) -> str:
    """`data` (JSON text) with every U+0085/U+2028/U+2029 written as its JSON escape."""
    if any(ch in data for ch in LINE_BREAKS):
        return data.translate(_ESCAPE)
    return data


def sse_event(data: str | bytes) -> bytes:
    """One SSE event carrying `data` (JSON text or `[DONE]`)."""
    if isinstance(data, bytes):
        data = data.decode()
    return f"data: {escape_line_breaks(data)}\n\n".encode()


def json_event(value: object) -> bytes:
    """One SSE event carrying `value` as JSON (an error body, a chunk built as a dict)."""
    return sse_event(dumps(value))


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _first_of(work: asyncio.Future, receive: Receive) -> bool:
    """Wait for `work` or the client's disconnect, whichever comes first; cancel the other. True if
    `work` ended. (Plain asyncio: an anyio task group costs 3x as much, on every request.)"""
    gone = asyncio.ensure_future(_wait_for_disconnect(receive))
    try:
        await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (gone, work):
            task.cancel()  # no-op once done
        await asyncio.gather(gone, work, return_exceptions=True)
    return not work.cancelled()


async def unless_disconnected(fn: Callable[[], Awaitable[T]], receive: Receive) -> tuple[bool, T | None]:
    """Run `fn()` until it returns or the client disconnects: (True, result) or (False, None)."""
    work = asyncio.ensure_future(fn())
    if not await _first_of(work, receive):
        return False, None
    return True, work.result()  # raises what fn() raised


class EventStream(Response):
    """An SSE response: sends `events` until they end or the client leaves; then `close()` runs,
    shielded from the disconnect's cancellation, however the exchange ended."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], close: Callable[[], Awaitable[None]] | None = None) -> None:
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no"})
        self.events, self.on_close = events, close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            sending = asyncio.ensure_future(self._send_all(send))
            if await _first_of(sending, receive) and isinstance(sending.exception(), OSError):
                return  # servers on ASGI spec 2.4 raise on a send to a gone client
            if not sending.cancelled():
                sending.result()  # raises what the stream raised
        finally:
            with anyio.CancelScope(shield=True):
                aclose = getattr(self.events, "aclose", None)
                if aclose is not None:
                    await aclose()
                if self.on_close is not None:
                    await self.on_close()

    async def _send_all(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for chunk in self.events:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
