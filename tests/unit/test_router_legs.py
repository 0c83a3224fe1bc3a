"""A leg against real HTTP servers on loopback: a generation server that cannot be reached took
nothing, so the leg goes to another one (JSON and streamed); one that answers an error is not retried."""

from __future__ import annotations

import asyncio

import pytest
from deploy_harness import free_port
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route
from waiting import uvicorn_in_thread

from server.config.router import RouterConfig
from server.router.backends import Backend
from server.router.errors import LegError
from server.router.http_client import HttpClient
from server.router.legs import Legs
from server.router.policies import Prompt
from server.router.routing import Routing


async def _answer(request):
    body = await request.json()
    if body.get("stream"):
        async def events():
            yield b'data: {"choices": [{"text": "ok"}]}\n\n'
            yield b"data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")
    if body.get("prompt") == "bad":
        return JSONResponse({"error": {"message": "prompt refused", "type": "invalid_request_error"}}, 400)
    return JSONResponse({"choices": [{"text": "ok"}]})


@pytest.fixture(scope="module")
def live_url():
    with uvicorn_in_thread(Starlette(routes=[Route("/v1/completions", _answer, methods=["POST"])])) as url:
        yield url


def _closed_port() -> str:
    return f"http://127.0.0.1:{free_port()}"  # free, below the ephemeral range: nothing listens


def _run(live_url: str, body: dict):
    async def run():
        dead, live = Backend(_closed_port(), "generation", healthy=True), Backend(live_url, "generation", healthy=True)
        routing = Routing(RouterConfig(), [], [dead, live], CollectorRegistry())
        client = HttpClient()
        legs = Legs(client, [], [dead, live], routing.context_picker, routing.generation_picker, 30.0)
        try:
            upstream = await legs.generation_leg("/v1/completions", body, Prompt(lambda: None), None)
            if upstream.stream is not None:
                chunks = b"".join([c async for c in upstream.stream.aiter_raw()])
                await upstream.stream.aclose()
                return upstream.backend is live, chunks, dead.healthy, (dead.active, live.active)
            return upstream.backend is live, upstream.json, dead.healthy, (dead.active, live.active)
        finally:
            await client.aclose()
    return asyncio.run(run())


@pytest.mark.parametrize("stream", [False, True])
def test_an_unreachable_generation_server_is_fenced_and_the_leg_goes_to_another(live_url, stream):
    on_live, answer, dead_healthy, active = _run(live_url, {"prompt": "x", "stream": stream})
    assert on_live and not dead_healthy and active == (0, 0)
    assert answer == ({"choices": [{"text": "ok"}]} if not stream else
                      b'data: {"choices": [{"text": "ok"}]}\n\ndata: [DONE]\n\n')


def test_a_server_that_answers_an_error_is_not_tried_again(live_url):
    with pytest.raises(LegError) as info:
        for _ in range(2):  # round robin: one of the two tries starts on the live server
            _run(live_url, {"prompt": "bad"})
    assert info.value.status == 400 and info.value.body["error"]["message"] == "prompt refused"
