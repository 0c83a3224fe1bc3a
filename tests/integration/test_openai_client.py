"""The real `openai` client against a live uvicorn server on a loopback port.

The server runs `server.api.create_app` in a thread with the unit tests' deterministic fake engine;
the `engine` fixture is the one place to swap in the real engine. Requests use temperature 0 and
`ignore_eos`, so the checks hold for any deterministic engine.
"""

from __future__ import annotations

import importlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from waiting import uvicorn_in_thread, wait_until

from server.api.app import create_app

UNIT_TESTS = Path(__file__).resolve().parents[1] / "unit"
START_TIMEOUT_S = 20.0
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def engine():
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(UNIT_TESTS))  # the fake engine lives with the unit tests
        fake = importlib.import_module("test_api_engine_fake")
    return fake.FakeEngine(max_seq_len=256)


@pytest.fixture(scope="module")
def base_url(engine):
    with uvicorn_in_thread(create_app(lambda: engine), START_TIMEOUT_S) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=30)


def test_models_and_health(client, base_url, engine):
    assert [m.id for m in client.models.list().data] == [engine.model_name]
    assert httpx.get(f"{base_url}/health", timeout=10).status_code == 200


def test_completion_text_and_usage(client, engine):
    prompt = "The capital of France is"
    out = client.completions.create(model=engine.model_name, prompt=prompt, max_tokens=8, **GREEDY)
    prompt_tokens = len(engine.tokenizer.encode(prompt))
    assert out.object == "text_completion"
    assert out.choices[0].finish_reason == "length"
    assert out.choices[0].text != ""
    assert out.usage.prompt_tokens == prompt_tokens
    assert out.usage.completion_tokens == 8
    assert out.usage.total_tokens == prompt_tokens + 8
    assert out.usage.prompt_tokens_details.cached_tokens >= 0


def test_completion_stream_equals_non_stream(client, engine):
    kwargs = {"model": engine.model_name, "prompt": "Once upon a time", "max_tokens": 12, **GREEDY}
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == []
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (
        whole.usage.prompt_tokens, 12)


def test_chat_stream_equals_non_stream(client, engine):
    messages = [{"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": "Name a colour."}]
    kwargs = {"model": engine.model_name, "messages": messages, "max_tokens": 10, **GREEDY}
    whole = client.chat.completions.create(**kwargs)
    stream = client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    chunks = list(stream)
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.completion_tokens == 10
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_concurrent_requests_match_sequential_ones(client, engine):
    prompts = [f"Request number {i} asks" for i in range(6)]

    def complete(prompt: str) -> str:
        out = client.completions.create(model=engine.model_name, prompt=prompt, max_tokens=6, **GREEDY)
        return out.choices[0].text

    sequential = [complete(p) for p in prompts]
    with ThreadPoolExecutor(max_workers=6) as pool:
        assert list(pool.map(complete, prompts)) == sequential


BAD_REQUESTS = [{"prompt": ""}, {"prompt": "hi", "n": 17}, {"prompt": "hi", "max_tokens": 10_000},
                {"prompt": "hi", "temperature": -1}, {"prompt": "hi", "top_p": 0}]


@pytest.mark.parametrize("bad", BAD_REQUESTS)
def test_bad_request_raises_bad_request_error_and_server_keeps_serving(client, engine, bad):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=engine.model_name, **{"max_tokens": 4, **bad})
    assert info.value.status_code == 400
    assert info.value.body["type"] == "invalid_request_error"
    assert info.value.body["param"] in {"prompt", "n", "max_tokens", "temperature", "top_p"}
    out = client.completions.create(model=engine.model_name, prompt="still alive", max_tokens=2, **GREEDY)
    assert out.usage.completion_tokens == 2


def test_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    assert info.value.body["code"] == "model_not_found"


def test_client_disconnect_mid_stream_aborts_the_request(base_url, engine):
    body = {"prompt": "HANG please", "max_tokens": 50, "stream": True}
    with httpx.Client(timeout=10) as http, http.stream("POST", f"{base_url}/v1/completions", json=body) as r:
        assert r.status_code == 200
        first = next(r.iter_lines())
        assert first.startswith("data: {")
    request_id = engine.requests[-1].request_id
    wait_until(lambda: request_id in engine.aborted, 5.0, what="the engine told to abort")
    assert request_id in engine.closed
