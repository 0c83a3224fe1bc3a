"""A client that goes away aborts its request in the engine (so its KV blocks are freed).

The app is driven at the ASGI level: `receive` hands over the body, then reports `http.disconnect`
at a chosen moment, as uvicorn does when the socket closes.
"""

from __future__ import annotations

import json

import anyio
import pytest
from test_api_engine_fake import FakeEngine

from server.api.app import create_app

pytestmark = pytest.mark.anyio
DEADLINE_S = 5.0  # the fake's silences last 30 s: finishing sooner proves the disconnect cut them


class Client:
    """One ASGI HTTP exchange whose client disconnects when `gone` is set."""

    def __init__(self, path: str, body: dict, hang_up_on_first_event: bool = True):
        self.path = path
        self.hang_up_on_first_event = hang_up_on_first_event
        self.body = json.dumps(body).encode()
        self.gone = anyio.Event()
        self.sent: list[dict] = []
        self._body_sent = False

    def scope(self) -> dict:
        return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                "method": "POST", "scheme": "http", "path": self.path, "raw_path": self.path.encode(),
                "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
                "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000)}

    async def receive(self) -> dict:
        if not self._body_sent:
            self._body_sent = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        self.sent.append(message)
        if self.hang_up_on_first_event and message["type"] == "http.response.body" and message.get("body"):
            self.gone.set()

    def body_text(self) -> str:
        return b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body").decode()


async def exchange(engine: FakeEngine, client: Client, hang_up_after_s: float | None = None) -> None:
    app = create_app(lambda: engine)
    async with app.router.lifespan_context(app):
        with anyio.fail_after(DEADLINE_S):
            async with anyio.create_task_group() as tg:
                if hang_up_after_s is not None:
                    async def hang_up() -> None:
                        await anyio.sleep(hang_up_after_s)
                        client.gone.set()
                    tg.start_soon(hang_up)
                await app(client.scope(), client.receive, client.send)


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
async def test_disconnect_mid_stream_aborts_the_request(route):
    engine = FakeEngine()
    body = {"max_tokens": 8, "stream": True}
    chat = {"messages": [{"role": "user", "content": "HANG"}]}
    body |= {"prompt": "HANG"} if route == "/v1/completions" else chat
    client = Client(route, body)
    await exchange(engine, client)
    request_id = engine.requests[0].request_id
    assert engine.aborted == [request_id]
    assert engine.closed == [request_id]
    assert client.sent[0]["status"] == 200
    assert client.body_text().startswith("data: {") and "[DONE]" not in client.body_text()


async def test_disconnect_before_first_token_of_a_stream_aborts():
    engine = FakeEngine()
    client = Client("/v1/completions", {"prompt": "HANGFIRST", "max_tokens": 8, "stream": True})
    await exchange(engine, client, hang_up_after_s=0.05)
    request_id = engine.requests[0].request_id
    assert engine.aborted == [request_id]
    assert engine.closed == [request_id]
    assert "data:" not in client.body_text()


@pytest.mark.parametrize("prompt", ["HANG", "HANGFIRST"])
async def test_disconnect_while_waiting_for_a_json_response_aborts(prompt):
    engine = FakeEngine()
    client = Client("/v1/completions", {"prompt": prompt, "max_tokens": 8})
    await exchange(engine, client, hang_up_after_s=0.05)
    request_id = engine.requests[0].request_id
    assert engine.aborted == [request_id]
    assert engine.closed == [request_id]
    assert client.body_text() == ""


@pytest.mark.parametrize("stream", [False, True])
async def test_a_finished_request_is_not_aborted(stream):
    engine = FakeEngine()
    client = Client("/v1/completions", {"prompt": "hello", "max_tokens": 3, "stream": stream},
                    hang_up_on_first_event=False)
    await exchange(engine, client)
    request_id = engine.requests[0].request_id
    assert engine.aborted == []
    assert engine.closed == [request_id]
    assert client.sent[0]["status"] == 200
    assert client.sent[-1].get("more_body", False) is False
    text = engine.expected_text(engine.tokenizer.encode("hello"), 3)
    if stream:
        assert client.body_text().endswith("data: [DONE]\n\n")
    else:
        assert json.loads(client.body_text())["choices"][0]["text"] == text


@pytest.mark.parametrize("stream", [False, True])
async def test_disconnect_aborts_every_engine_request_of_several_prompts(stream):
    engine = FakeEngine()
    client = Client("/v1/completions", {"prompt": ["ok", "HANG", "HANGFIRST"], "n": 2, "max_tokens": 8,
                                        "stream": stream}, hang_up_on_first_event=False)
    await exchange(engine, client, hang_up_after_s=0.1)
    ids = [r.request_id for r in engine.requests]
    assert len(ids) == 3 and ids[0].endswith("-0") and ids[2].endswith("-2")
    assert sorted(engine.aborted) == sorted(ids[1:])  # the first prompt's choices had finished
    assert sorted(engine.closed) == sorted(ids)
    assert "[DONE]" not in client.body_text()


@pytest.mark.parametrize("stream", [False, True])
async def test_finished_choices_of_several_prompts_are_not_aborted(stream):
    engine = FakeEngine()
    client = Client("/v1/completions", {"prompt": ["ab", "cd"], "n": 3, "max_tokens": 2, "stream": stream},
                    hang_up_on_first_event=False)
    await exchange(engine, client)
    assert engine.aborted == []
    assert sorted(engine.closed) == sorted(r.request_id for r in engine.requests)
