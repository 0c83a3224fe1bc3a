"""The router's half of streamed KV: a context leg that answers early.

A context server that streams this prompt (server/api/generation.py `respond_context`) answers with an SSE stream
whose first event holds the lease's parameters (`EarlyContext`), so the generation leg starts at
once; the second event is the context answer, or its error. A server that does not stream the
prompt answers plain JSON."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from server.openai.protocol import DISAGG_PARAMS, DisaggParams
from server.openai.wire import loads
from server.router.backends import Backend
from server.router.errors import LegError
from server.router.http_client import HttpError, Response, StreamResponse

EVENT_STREAM = "text/event-stream"
END = b"\n\n"


class EventSplitter:
    """The router's one SSE parser (here and in the relay of a generation leg that may move): feed it
    chunks as they arrive; it returns the complete events so far, each ending with a blank line (b"" if
    none; a partial event waits)."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> bytes:
        buffer = self._buffer + chunk
        end = buffer.rfind(END)
        if end < 0:
            self._buffer = buffer
            return b""
        self._buffer = buffer[end + 2:]
        return buffer[:end + 2]


def split_events(complete: bytes) -> list[bytes]:
    """Complete events (what `EventSplitter.feed` returned) one by one, without their blank line."""
    return complete[:-2].split(END) if complete else []


class Events:
    """`data:` payloads of an SSE body as JSON values, one per event (None once it has ended)."""

    def __init__(self, stream: StreamResponse) -> None:
        self._chunks: AsyncIterator[bytes] = stream.aiter_raw()
        self._splitter = EventSplitter()
        self._events: list[bytes] = []

    async def next(self) -> object | None:
        while not self._events:
            chunk = await anext(self._chunks, None)
            if chunk is None:
                return None
            self._events = split_events(self._splitter.feed(chunk))
        # the JSON value of the event's `data:` lines (None for `[DONE]` or an event without data)
        data = b"".join(line[5:].strip() for line in self._events.pop(0).split(b"\n") if line.startswith(b"data:"))
        return None if data in (b"", b"[DONE]") else loads(data)


@dataclass
class EarlyContext:
    """A context leg whose lease came before its first token."""

    backend: Backend
    params: DisaggParams  # context_only, kv_stream: the lease, the KV endpoint and epoch, the prompt's ids
    events: Events
    stream: StreamResponse
    done: Callable[[], None]  # ends the leg's booking (and records its time)

    async def rest(self) -> dict:
        """The context answer (its error as a LegError); the leg ends either way."""
        try:
            event = await self.events.next()
        except HttpError as exc:
            self.backend.fence(f"{type(exc).__name__}: {exc}")
            raise LegError(502, f"context leg failed: {self.backend.url} broke the stream ({type(exc).__name__})") \
                from exc
        finally:
            await self.close()
        if not isinstance(event, dict) or not isinstance(event.get("body"), dict):
            raise LegError(502, f"context leg failed: {self.backend.url} ended the stream without an answer")
        status, body = event.get("status"), event["body"]
        if status == 200:
            return body
        message = str((body.get("error") or {}).get("message") or f"HTTP {status}")
        status = status if isinstance(status, int) and 400 <= status < 600 else 502
        raise LegError(status, f"context leg failed: {message}", body if status < 500 else None)

    async def close(self) -> None:
        """Idempotent: closes the context server's stream (it aborts the request if it is unfinished)."""
        done, self.done = self.done, lambda: None
        done()
        await self.stream.aclose()


async def read_context(backend: Backend, response: StreamResponse, done: Callable[[], None],
                       parse: Callable[[Backend, Response], dict]) -> dict | EarlyContext:
    """A context leg's answer: its JSON, or its early event (`done()` runs when the leg ends)."""
    try:
        if response.status != 200 or response.content_type != EVENT_STREAM:
            return parse(backend, await response.whole())
        events = Events(response)
        first = await events.next()
    except HttpError as exc:
        await response.aclose()
        backend.fence(f"{type(exc).__name__}: {exc}")
        raise LegError(502, f"{backend.url} broke the exchange ({type(exc).__name__})") from exc
    except BaseException:
        await response.aclose()
        raise
    if not isinstance(first, dict) or not isinstance(first.get("kv_stream"), dict):
        await response.aclose()
        raise LegError(502, f"{backend.url} sent no streamed-KV parameters")
    return EarlyContext(backend, DISAGG_PARAMS.validate_python(first["kv_stream"]), events, response, done)
