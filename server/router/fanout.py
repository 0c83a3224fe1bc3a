"""A completions request of several prompts on a disaggregated deployment: one request flow per
prompt (each leg carries one prompt), answered as one response.

Choices are numbered as OpenAI numbers them: prompt p's choice c is p * n + c. A JSON answer joins
the flows' choices and sums their usage; a stream interleaves the flows' events as they come,
renumbered and under one id, with one usage chunk (the sum) at the end if asked. Whatever way the
request ends, every flow is closed (each releases what it holds).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from starlette.responses import Response
from starlette.types import Receive

from server.openai.sse import DONE, EventStream, json_event, unless_disconnected
from server.openai.wire import JSONBody, loads
from server.router.flow import ClientGone, RequestFlow
from server.router.sse_reader import EventSplitter, event_data, split_events


def several_prompts(body: dict) -> list | None:
    """The prompts of a completions body that holds more than one (strings or token-id lists)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str | list) for p in prompt):
        return prompt
    return None


async def fan_out(flows: list[RequestFlow], receive: Receive, n: int, include_usage: bool) -> Response:
    """The flows' responses as one; the first flow to fail ends them all, with its error."""
    try:
        done, answers = await unless_disconnected(lambda: _answers(flows), receive)
    except BaseException:
        await asyncio.shield(asyncio.gather(*(flow.close() for flow in flows)))
        raise
    if not done:
        await asyncio.shield(asyncio.gather(*(flow.close() for flow in flows)))
        raise ClientGone()
    if isinstance(answers[0], EventStream):
        return EventStream(_merged(answers, n, include_usage), lambda: _close_all(answers))
    bodies = [loads(a.body) for a in answers]
    for p, body in enumerate(bodies):
        _renumber(body, p * n)
    joined = {**bodies[0], "choices": [c for b in bodies for c in b["choices"]], "usage": _sum_usage(bodies)}
    return JSONBody(joined)


async def _answers(flows: list[RequestFlow]) -> list[Response]:
    tasks = [asyncio.ensure_future(flow.answer()) for flow in flows]
    try:
        return await asyncio.gather(*tasks)
    finally:  # one failed, or the client left: the others stop before their flows are closed
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _merged(streams: list[EventStream], n: int, include_usage: bool) -> AsyncIterator[bytes]:
    queue: asyncio.Queue[tuple[int, bytes | None]] = asyncio.Queue()
    pumps = [asyncio.ensure_future(_pump(p, s.events, queue.put_nowait)) for p, s in enumerate(streams)]
    splitters = [EventSplitter() for _ in streams]
    usages: list[dict] = []
    response_id, open_streams = None, len(streams)
    try:
        while open_streams:
            p, chunk = await queue.get()
            if chunk is None:
                open_streams -= 1
                continue
            for event in split_events(splitters[p].feed(chunk)):
                data = event_data(event)
                if not isinstance(data, dict) or "choices" not in data:
                    if data is not None:  # an error event
                        yield event + b"\n\n"
                    continue
                if not data["choices"] and data.get("usage"):
                    usages.append(data)
                    continue
                response_id = response_id or data.get("id")
                _renumber(data, p * n)
                yield json_event({**data, "id": response_id})
        if include_usage and usages:
            yield json_event({**usages[0], "id": response_id or usages[0].get("id"), "usage": _sum_usage(usages)})
        yield DONE
    finally:
        for pump in pumps:
            pump.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


async def _pump(p: int, events: AsyncIterator[bytes], put: Callable[[tuple[int, bytes | None]], None]) -> None:
    try:
        async for chunk in events:
            put((p, chunk))
    finally:
        put((p, None))


def _renumber(body: dict, offset: int) -> None:
    for choice in body.get("choices") or []:
        choice["index"] = choice.get("index", 0) + offset


def _sum_usage(bodies: list[dict]) -> dict | None:
    usages = [b["usage"] for b in bodies if b.get("usage")]
    if not usages:
        return None
    total = {k: sum(u.get(k, 0) for u in usages) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    cached = sum((u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) for u in usages)
    return {**total, "prompt_tokens_details": {"cached_tokens": cached}}


async def _close(stream: EventStream) -> None:
    aclose = getattr(stream.events, "aclose", None)
    if aclose is not None:
        await aclose()
    if stream.on_close is not None:
        await stream.on_close()


async def _close_all(streams: list[EventStream]) -> None:
    await asyncio.gather(*(_close(s) for s in streams))
