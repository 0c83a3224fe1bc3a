"""The router's own stream pieces: the opening events made from a context answer, the parameters of
the generation leg, and the request's flow that follows (leg failures and client departures)."""

from __future__ import annotations

import asyncio
import json

from server.openai.formatting import continued_response_id
from server.openai.protocol import DisaggParams
from server.openai.sse import DONE
from server.router.answers import context_params, opening_events
from server.router.backends import Backend
from server.router.errors import LegError
from server.router.flow import Ask, ClientGone, RequestFlow
from server.router.http_client import ReadError, StreamResponse
from server.router.legs import Upstream
from server.router.migration import Migration
from server.router.policies import Prompt

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
    assert event["id"] == continued_response_id("cmpl-ctx1") != "cmpl-ctx1"  # not the lease key
    assert event["object"] == "text_completion" and event["model"] == "m"
    assert event["choices"][0]["text"] == " Hel" and event["choices"][0]["finish_reason"] is None


def test_held_back_text_opens_nothing_for_completions_and_only_the_role_for_chat():
    assert opening_events(_ctx("", chat=False), chat=False) == []
    [role] = _events(opening_events(_ctx(None, chat=True), chat=True))
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}


def test_chat_opening_is_the_role_then_the_first_text():
    role, text = _events(opening_events(_ctx("Hi", chat=True), chat=True))
    assert role["object"] == text["object"] == "chat.completion.chunk"
    assert role["choices"][0]["delta"]["role"] == "assistant"
    assert text["choices"][0]["delta"]["content"] == "Hi" and text["id"] == role["id"]


def test_the_generation_legs_parameters_are_the_context_answers_as_generation_only():
    ctx = context_params(_ctx("x", chat=False))
    generation_only = {**PARAMS, "request_type": "generation_only"}
    json_flow = RequestFlow(_Legs(None, []), Ask("/v1/completions", {}, False, Prompt(lambda: None)), local=False)
    assert json_flow._handoff(ctx) == DisaggParams(**generation_only)
    legs = _Legs(None, [])
    legs.migration_limit = 1
    stream = RequestFlow(legs, Ask("/v1/completions", {"stream": True}, False, Prompt(lambda: None)), local=False)
    assert stream._handoff(ctx) == DisaggParams(**generation_only, first_text_streamed=True, report_tokens=True)
    # the client has tokens 5, 6; the context leg sampled 7
    stream._migration = Migration("cmpl-client", [1, 2], [5, 6], limit=1)
    moved = stream._handoff(ctx, moved=True)
    assert moved == DisaggParams(**generation_only, first_text_streamed=True, report_tokens=True,
                                 response_id="cmpl-client", prior_output_tokens=2)
    assert stream._migration.tokens == [5, 6, 7]


class _Legs:
    """`Legs` as a RequestFlow sees them: the context leg answers `CTX`, the generation leg is `leg`."""

    def __init__(self, leg, released: list[str], release_wait: bool = False) -> None:
        self.leg, self.released, self.release_wait = leg, released, release_wait
        self.migration_limit, self.generation = 0, []

    def require_generation(self) -> None:
        pass

    async def context_leg(self, *args, **kwargs) -> Upstream:
        return Upstream(Backend("http://ctx", "context"), json=_ctx("first", chat=False))

    def generation_leg(self, *args, **kwargs):
        return self.leg()

    async def release_context(self, backend, params) -> None:
        if self.release_wait:
            await asyncio.sleep(0)  # an await that an unshielded, cancelled cleanup would not get past
        self.released.append("released")


def _flow(leg, released: list[str], release_wait: bool = False) -> RequestFlow:
    ask = Ask("/v1/completions", {"prompt": "x", "stream": True}, False, Prompt(lambda: None))
    return RequestFlow(_Legs(leg, released, release_wait), ask, local=False)


async def _connected() -> dict:
    await asyncio.sleep(60)
    return {"type": "http.disconnect"}


def _collect(leg, released: list[str]) -> list[bytes]:
    """The events of a streamed disaggregated request whose context answer's first text is "first"."""
    async def run() -> list[bytes]:
        response = await _flow(leg, released).respond(_connected)
        events = [e async for e in response.events]
        await response.on_close()
        return events
    return asyncio.run(run())


def test_a_failed_generation_leg_ends_the_stream_with_an_error_naming_it_and_releases_the_lease():
    async def leg() -> Upstream:
        raise LegError(400, "prompt too long", {"error": {"message": "prompt too long", "type": "x"}})

    released: list[str] = []
    raw = _collect(leg, released)
    assert raw[-1] == DONE and released == ["released"]
    first, error = _events(raw)
    assert first["choices"][0]["text"] == "first"
    assert error["error"]["message"] == "generation leg failed (HTTP 400): prompt too long"


def test_an_unexpected_leg_exception_is_reported_too():
    async def leg() -> Upstream:
        raise ReadError("broken pipe")

    released: list[str] = []
    _, error = _events(_collect(leg, released))
    assert error["error"]["message"] == "generation leg failed: ReadError: broken pipe"
    assert released == ["released"]


class _Body:
    def __init__(self) -> None:
        self.closed = False

    async def chunks(self):
        yield b'data: {"choices": [{"text": "lo"}]}\n\n'
        yield b"data: [DONE]\n\n"

    async def aclose(self) -> None:
        self.closed = True


def test_the_generation_stream_follows_the_opening_and_the_lease_is_left_to_the_generation_server():
    body = _Body()

    async def leg() -> Upstream:
        return Upstream(Backend("http://gen", "generation"), stream=StreamResponse(200, body.chunks(), body.aclose))

    released: list[str] = []
    raw = _collect(leg, released)
    assert _events(raw[:1])[0]["choices"][0]["text"] == "first"
    assert b"".join(raw[1:]) == b'data: {"choices": [{"text": "lo"}]}\n\ndata: [DONE]\n\n'
    assert released == [] and body.closed


async def _pending_leg(started: asyncio.Event, cancelled: list[bool]) -> Upstream:
    started.set()
    try:
        await asyncio.sleep(60)
    except asyncio.CancelledError:
        cancelled.append(True)
        raise
    raise AssertionError("not reached")


def _run_response(leg, disconnect_when) -> tuple[list[dict], list[str]]:
    """The flow's response as Starlette serves it; the client disconnects when `disconnect_when` is set."""
    sent: list[dict] = []
    released: list[str] = []

    async def run() -> None:
        gone = disconnect_when()

        async def receive() -> dict:
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            sent.append(message)

        try:
            response = await _flow(leg, released, release_wait=True).respond(receive)
        except ClientGone:
            return
        scope = {"type": "http", "asgi": {"spec_version": "2.3"}, "method": "POST", "path": "/"}
        await asyncio.wait_for(response(scope, receive, send), 10)
    asyncio.run(run())
    return sent, released


def test_a_client_gone_while_the_leg_opens_cancels_it_and_releases_the_lease():
    started, cancelled = asyncio.Event(), []

    def disconnect_when() -> asyncio.Event:
        return started  # the client leaves as soon as the leg is under way

    sent, released = _run_response(lambda: _pending_leg(started, cancelled), disconnect_when)
    assert cancelled == [True] and released == ["released"]
    assert any(b'"text":"first"' in m.get("body", b"") for m in sent)  # the opening went out first


def test_a_client_gone_before_the_stream_started_still_releases_the_lease():
    legs: list[str] = []

    async def leg() -> Upstream:
        legs.append("called")
        raise AssertionError("the leg must not matter here")

    def disconnect_when() -> asyncio.Event:
        gone = asyncio.Event()
        gone.set()  # already gone
        return gone

    _, released = _run_response(leg, disconnect_when)
    assert released == ["released"]


def test_the_router_reads_stream_as_the_servers_do():
    from fastapi.testclient import TestClient

    from server.config.router import RouterConfig
    from server.router.app import create_router_app

    settings = RouterConfig(context_urls=("127.0.0.1:9",), generation_urls=("127.0.0.1:9",), health_interval_s=60)
    with TestClient(create_router_app(settings)) as client:
        bad = client.post("/v1/completions", json={"prompt": "x", "stream": "maybe"})
        assert bad.status_code == 400 and "stream must be a boolean" in bad.json()["error"]["message"]
        # "false" is a boolean to the servers too: the request goes on (to no healthy server here)
        fine = client.post("/v1/completions", json={"prompt": "x", "stream": "false"})
        assert fine.status_code == 503, fine.text


def test_the_router_answers_bad_paths_methods_and_bodies_with_json_errors():
    from fastapi.testclient import TestClient

    from server.config.router import RouterConfig
    from server.router.app import create_router_app

    settings = RouterConfig(context_urls=("127.0.0.1:9",), generation_urls=("127.0.0.1:9",), health_interval_s=60)
    with TestClient(create_router_app(settings)) as client:
        missing = client.post("/v1/nothing", json={})
        assert missing.status_code == 404 and "/v1/nothing" in missing.json()["error"]["message"]
        wrong = client.get("/v1/completions")
        assert wrong.status_code == 405 and "GET /v1/completions" in wrong.json()["error"]["message"]
        assert "POST" in wrong.headers["allow"]
        for body, says in [(b"{nope", "malformed JSON"), (b"[1, 2]", "must be a JSON object")]:
            bad = client.post("/v1/completions", content=body)
            assert bad.status_code == 400 and says in bad.json()["error"]["message"], bad.text
