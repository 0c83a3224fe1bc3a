"""The router's SSE streams: relayed from a generation server, made from a finished context answer,
or opened by the router itself with the context answer's first token before the generation leg runs.

Streaming the first token from the context answer takes the generation leg's setup (an HTTP
exchange, the generation server's admission) off the time to first token. The generation server
is told so (`first_text_streamed`) and streams only what follows, under the same response id. The
context server reports exactly the text the generation server would stream for that token (text
that might still become a stop string, or an incomplete UTF-8 character, stays held back), so the
two parts join without a gap or a repeat. Once the first event is out the HTTP status is 200, so a
generation leg that fails after it ends the stream with an error event that names the leg.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

from server.openai.errors import error_body
from server.openai.sse import DONE, EventStream, json_event
from server.router.backends import Backend
from server.router.context_events import closing_events
from server.router.errors import LegError
from server.router.http_client import HttpError, StreamResponse
from server.router.migration import Migration
from server.router.orchestrator import Upstream

MID_STREAM = 500  # the status an error event's type is named after: the stream itself is a 200


def mid_stream_error(message: str) -> bytes:
    return json_event(error_body(MID_STREAM, message))


async def relay_sse(upstream: StreamResponse, backend: Backend) -> AsyncIterator[bytes]:
    """Pass the generation server's SSE bytes through as they arrive; closing stops the upstream
    (and ends the leg's booking: server/router/queue.py)."""
    try:
        async for chunk in upstream.aiter_raw():
            yield chunk
    except HttpError as exc:
        message = f"generation leg failed mid-stream: {type(exc).__name__}"
        yield mid_stream_error(message)
        backend.fence(message)
    finally:
        await upstream.aclose()


async def sse_from_final(body: dict, chat: bool, include_usage: bool) -> AsyncIterator[bytes]:
    """Turn a finished non-streaming answer (context leg ended the request) into SSE events."""
    for event in closing_events(body, chat, body.get("id") or "", include_usage):
        yield event


class ContextFirstStream:
    """`opening`, then the generation leg's stream; the leg starts before the first event is sent.

    With a `migration` (server/router/migration.py) the relay passes whole events and notes their
    tokens; if the generation server dies mid-stream the request moves to another one and the
    client's stream goes on. `close()` ends it however the response ended (finished, leg failed,
    client gone before or while the leg opened, or before the stream even started): a leg still
    opening is cancelled, an opened upstream is closed (the generation server then aborts and frees
    the lease itself), and if the latest generation leg never opened, `release()` frees its context
    lease at once.
    """

    def __init__(self, opening: list[bytes], leg: Callable[[], Awaitable[Upstream]],
                 release: Callable[[], Awaitable[None]], migration: Migration | None = None) -> None:
        self._opening, self._leg, self._release = opening, leg, release
        self._migration = migration
        self._task: asyncio.Future[Upstream] | None = None
        self._closed = False

    async def events(self) -> AsyncIterator[bytes]:
        self._task = asyncio.ensure_future(self._leg())
        for event in self._opening:
            yield event
        while self._task is not None:
            task = self._task
            try:
                upstream = await task
            except Exception as exc:  # the generation leg failed before its stream opened
                if isinstance(exc, LegError) and exc.lost and self._can_move(None):
                    async for event in self._move():
                        yield event
                    continue
                yield json_event(_leg_error(exc))
                yield DONE
                return
            async for event in self._relay(upstream):
                yield event
            if self._task is task:  # the request did not move: its stream has ended
                return

    async def _relay(self, upstream: Upstream) -> AsyncIterator[bytes]:
        """One generation leg's events; on a broken stream, move the request on or end with an error."""
        if self._migration is None:
            async for chunk in relay_sse(upstream.stream, upstream.backend):
                yield chunk
            return
        tracker = self._migration.tracker()
        try:
            async for chunk in upstream.stream.aiter_raw():
                if forward := tracker.feed(chunk):
                    yield forward
            return
        except HttpError as exc:
            failure = f"generation leg failed mid-stream: {type(exc).__name__}"
        finally:
            await upstream.stream.aclose()  # ends the leg's booking (server/router/queue.py)
        upstream.backend.fence(failure)
        if tracker.finished:  # everything was generated; only the end of the stream was lost
            yield DONE
        elif self._can_move(upstream.backend):
            async for event in self._move():
                yield event
        else:
            yield mid_stream_error(failure)

    def _can_move(self, dead: Backend | None) -> bool:
        if self._migration is None:
            return False
        if dead is not None:
            self._migration.dead.add(dead)
        return self._migration.possible()

    async def _move(self) -> AsyncIterator[bytes]:
        """A new context leg from the tokens so far, its first text, then a new generation leg."""
        migration = self._migration
        assert migration is not None
        try:
            events, ctx, params = await migration.move()
        except LegError as exc:
            self._task, self._release = None, _nothing
            yield mid_stream_error(f"generation leg failed mid-stream and could not move on: {exc}")
            yield DONE
            return
        if ctx is None:  # that context leg finished the request: no lease, nothing more to relay
            self._task, self._release = None, _nothing
        else:
            self._task = asyncio.ensure_future(migration.generation_leg(params)())
            self._release = lambda: migration.orchestrator.release_context(ctx.backend, params)
        for event in events:
            yield event

    async def close(self) -> None:
        """Idempotent. Run it shielded from cancellation (`EventStream` does)."""
        if self._closed:
            return
        self._closed = True
        task, self._task = self._task, None
        opened = None
        if task is not None:
            task.cancel()  # no-op once done
            opened = (await asyncio.gather(task, return_exceptions=True))[0]
        if isinstance(opened, Upstream) and opened.stream is not None:
            await opened.stream.aclose()  # idempotent; the relay may have closed it already
        else:  # the latest generation leg never opened (or never started): free its lease now
            await self._release()


def context_first_response(stream: ContextFirstStream) -> EventStream:
    """A `ContextFirstStream` as an SSE response that closes it when the exchange ends, however it ends."""
    return EventStream(stream.events(), stream.close)


async def _nothing() -> None:
    return None


def relay_response(upstream: StreamResponse, backend: Backend) -> EventStream:
    """The generation server's stream relayed as is; the upstream is closed when the exchange ends,
    however it ends, even if the client left before the first byte (the relay never started)."""
    return EventStream(relay_sse(upstream, backend), upstream.aclose)


def _leg_error(exc: Exception) -> dict:
    """The error event's body: the generation server's own error, said to come from that leg."""
    if not isinstance(exc, LegError):
        return error_body(MID_STREAM, f"generation leg failed: {type(exc).__name__}: {exc}")
    error = dict(exc.body.get("error") or {})
    body = {**exc.body, "error": error}
    message = str(error.get("message") or exc)
    if not message.startswith("generation leg failed"):
        message = f"generation leg failed (HTTP {exc.status}): {message}"
    error["message"] = message
    return body
