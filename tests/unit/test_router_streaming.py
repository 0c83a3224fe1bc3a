"""The router's own stream pieces: the opening events made from a context answer, the parameters of
the generation leg, and the stream that follows (leg failures and client departures)."""

from __future__ import annotations

import asyncio
import json

import httpx

from server.router.backends import Backend
from server.router.orchestrator import LegError, Upstream
from server.router.streaming import DONE, generation_params, opening_events, stream_after_context

PARAMS = {"request_type": "context_only", "ctx_request_id": "cmpl-ctx1", "ctx_endpoint": "tcp://127.0.0.1:1",
          "ctx_epoch": "e1", "first_gen_tokens": [7], "prompt_token_ids": [1, 2, 3], "ctx_cached_tokens": 0}


def _ctx(text: str | None, chat: bool) -> dict:
    choice = {"index": 0, "finish_reason": None, "disaggregated_params": PARAMS}
    choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
    return {"id": "cmpl-ctx1", "object": "x", "created": 1, "model": "m", "choices": [choice]}


def _events(raw: list[bytes]) -> list[dict]:
    assert all(e.startswith(b"data: ") and e.endswith(b"\n\n") for e in raw)
    return [json.loads(e[6:]) for e in raw if e != DONE]


def test_completion_opening_is_the_first_text_under_the_context_id():
    [event] = _events(opening_events(_ctx(" Hel", chat=False), chat=False))
    assert event["id"] == "cmpl-ctx1" and event["object"] == "text_completion" and event["model"] == "m"
    assert event["choices"][0]["text"] == " Hel" and event["choices"][0]["finish_reason"] is None


def test_held_back_text_opens_nothing_for_completions_and_only_the_role_for_chat():
    assert opening_events(_ctx("", chat=False), chat=False) == []
    [role] = _events(opening_events(_ctx(None, chat=True), chat=True))
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}


def test_chat_opening_is_the_role_then_the_first_text():
    role, text = _events(opening_events(_ctx("Hi", chat=True), chat=True))
    assert role["object"] == text["object"] == "chat.completion.chunk"
    assert role["choices"][0]["delta"]["role"] == "assistant"
    assert text["choices"][0]["delta"]["content"] == "Hi" and text["id"] == "cmpl-ctx1"


def test_generation_params_carry_the_context_answer_and_the_streamed_flag():
    params = generation_params(_ctx("x", chat=False), first_text_streamed=True)
    assert params == {**PARAMS, "request_type": "generation_only", "first_text_streamed": True}


def _collect(opening, leg, released: list[str]) -> list[bytes]:
    async def release() -> None:
        released.append("released")

    async def run() -> list[bytes]:
        return [e async for e in stream_after_context(opening, leg, release)]
    return asyncio.run(run())


def test_a_failed_generation_leg_ends_the_stream_with_an_error_naming_it_and_releases_the_lease():
    async def leg() -> Upstream:
        raise LegError(400, "prompt too long", {"error": {"message": "prompt too long", "type": "x"}})

    released: list[str] = []
    raw = _collect([b"data: {\"first\": 1}\n\n"], leg, released)
    assert raw[-1] == DONE and released == ["released"]
    first, error = _events(raw)
    assert first == {"first": 1}
    assert error["error"]["message"] == "generation leg failed (HTTP 400): prompt too long"


def test_an_unexpected_leg_exception_is_reported_too():
    async def leg() -> Upstream:
        raise httpx.WriteError("broken pipe")

    released: list[str] = []
    [error] = _events(_collect([], leg, released))
    assert error["error"]["message"] == "generation leg failed: WriteError: broken pipe"
    assert released == ["released"]


def test_the_generation_stream_follows_the_opening():
    class Body(httpx.AsyncByteStream):
        async def __aiter__(self):
            yield b'data: {"choices": [{"text": "lo"}]}\n\n'
            yield b"data: [DONE]\n\n"

    async def leg() -> Upstream:
        return Upstream(Backend("http://gen", "generation"), stream=httpx.Response(200, stream=Body()))

    released: list[str] = []
    raw = b"".join(_collect([b"data: {\"first\": 1}\n\n"], leg, released))
    assert raw == b'data: {"first": 1}\n\ndata: {"choices": [{"text": "lo"}]}\n\ndata: [DONE]\n\n'
    assert released == []


def test_a_client_gone_before_the_leg_answers_cancels_it_and_releases_the_lease():
    started, cancelled = asyncio.Event(), []

    async def leg() -> Upstream:
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    released: list[str] = []

    async def release() -> None:
        released.append("released")

    async def run() -> None:
        events = stream_after_context([b"data: {}\n\n"], leg, release)
        consumer = asyncio.ensure_future(anext(events))
        assert await consumer == b"data: {}\n\n"
        waiting = asyncio.ensure_future(anext(events))
        await asyncio.wait_for(started.wait(), 5)
        waiting.cancel()  # what Starlette does when the client disconnects
        await asyncio.gather(waiting, return_exceptions=True)
    asyncio.run(run())
    assert cancelled == [True] and released == ["released"]
