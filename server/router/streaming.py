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
import json
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx

from server.api.formatting import ChatFormatter, CompletionFormatter
from server.router.backends import Backend
from server.router.orchestrator import LegError, Upstream, error_body
from server.types import RequestOutput

DONE = b"data: [DONE]\n\n"


def sse(data: str) -> bytes:
    return f"data: {data}\n\n".encode()


async def relay_sse(upstream: httpx.Response, backend: Backend) -> AsyncIterator[bytes]:
    """Pass the generation server's SSE bytes through as they arrive; closing stops the upstream."""
    backend.active += 1
    try:
        async for chunk in upstream.aiter_raw():
            yield chunk
    except httpx.HTTPError as exc:
        message = f"generation leg failed mid-stream: {type(exc).__name__}"
        yield sse(json.dumps(error_body(message)))
        backend.fence(message)
    finally:
        backend.active -= 1
        await upstream.aclose()


def sse_from_final(body: dict, chat: bool, include_usage: bool) -> AsyncIterator[bytes]:
    """Turn a finished non-streaming answer (context leg ended the request) into SSE events."""
    async def events() -> AsyncIterator[bytes]:
        for chunk in final_chunks(body, chat, include_usage):
            yield sse(json.dumps(chunk))
        yield DONE
    return events()


def final_chunks(body: dict, chat: bool, include_usage: bool) -> list[dict]:
    choice = dict(body["choices"][0])
    choice.pop("disaggregated_params", None)
    kind = "chat.completion.chunk" if chat else "text_completion"
    if chat:
        message = choice.pop("message", {}) or {}
        choice["delta"] = {"role": "assistant", "content": message.get("content", "")}
    base = {"id": body.get("id"), "object": kind, "created": body.get("created"), "model": body.get("model")}
    chunks = [{**base, "choices": [choice]}]
    if include_usage:
        chunks.append({**base, "choices": [], "usage": body.get("usage")})
    return chunks


def opening_events(ctx: dict, chat: bool) -> list[bytes]:
    """The stream's first events from an unfinished context answer: the chat role chunk and the
    first token's text (none when that text is still held back), under the id `ctx_request_id`,
    with the same formatters the servers use."""
    choice = ctx["choices"][0]
    response_id = choice["disaggregated_params"]["ctx_request_id"]
    text = ((choice.get("message") or {}).get("content") if chat else choice.get("text")) or ""
    fmt = (ChatFormatter if chat else CompletionFormatter)(response_id, ctx.get("model") or "")
    return [sse(data) for data in fmt.chunks(RequestOutput(response_id, [], text, finished=False))]


def generation_params(ctx: dict, first_text_streamed: bool) -> dict:
    params = ctx["choices"][0]["disaggregated_params"]
    return {**params, "request_type": "generation_only", "first_text_streamed": first_text_streamed}


async def stream_after_context(opening: list[bytes], leg: Callable[[], Awaitable[Upstream]],
                               release: Callable[[], Awaitable[None]]) -> AsyncIterator[bytes]:
    """`opening`, then the generation leg's stream. The leg starts before the first event is sent.
    If it fails, or the client leaves before it answers, `release()` frees the context lease."""
    task = asyncio.ensure_future(leg())
    try:
        for event in opening:
            yield event
        upstream = await task
    except Exception as exc:  # the generation leg failed before its stream opened
        await asyncio.shield(release())
        yield sse(json.dumps(_leg_error(exc)))
        yield DONE
        return
    except BaseException:  # the client went away (cancelled) before the stream was relayed
        task.cancel()
        opened = (await asyncio.gather(task, return_exceptions=True))[0]
        if isinstance(opened, Upstream) and opened.stream is not None:
            await asyncio.shield(opened.stream.aclose())  # the generation server aborts and releases
        else:
            await asyncio.shield(release())
        raise
    async for chunk in relay_sse(upstream.stream, upstream.backend):
        yield chunk


def _leg_error(exc: Exception) -> dict:
    """The error event's body: the generation server's own error, said to come from that leg."""
    if not isinstance(exc, LegError):
        return error_body(f"generation leg failed: {type(exc).__name__}: {exc}")
    body = json.loads(json.dumps(exc.body))
    error = body.setdefault("error", {})
    message = str(error.get("message") or exc)
    if not message.startswith("generation leg failed"):
        message = f"generation leg failed (HTTP {exc.status}): {message}"
    error["message"] = message
    return body
