"""Completions and chat through the HTTP layer: exact text, SSE framing, usage, request mapping."""

from __future__ import annotations

import json
import re

import pytest
from fastapi.testclient import TestClient
from test_api_engine_fake import TOKEN, FakeEngine, deployment_app, sse_chunks, sse_events

from server.api.app import create_app
from server.types import DisaggParams, SamplingParams

MAX_SEQ_LEN = 128
CHAT_PROMPT = "<|system|>be brief\n<|user|>hi\n<|assistant|>"


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine(max_seq_len=MAX_SEQ_LEN)


@pytest.fixture
def client(engine):
    with TestClient(deployment_app(lambda: engine), headers={"x-pdserve-token": TOKEN}) as c:
        yield c


def messages() -> list[dict]:
    return [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


def stream(client: TestClient, route: str, body: dict) -> tuple[list[dict], str]:
    response = client.post(route, json={**body, "stream": True})
    chunks = sse_chunks(response)
    assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
    return chunks, response.text


def test_completion_json_has_exact_text_usage_and_ids(client, engine):
    body = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 5}).json()
    prompt_ids = engine.tokenizer.encode("hello")
    assert body["object"] == "text_completion"
    assert body["model"] == "fake-model"
    assert body["id"].startswith("cmpl-") and body["id"] == engine.requests[-1].request_id
    assert body["choices"] == [{"index": 0, "text": engine.expected_text(prompt_ids, 5), "logprobs": None,
                                "finish_reason": "length", "disaggregated_params": None}]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert engine.requests[-1].prompt_token_ids == prompt_ids


def test_repeated_prompt_reports_cached_tokens(client):
    prompt = "the same long prompt"  # 20 tokens: the fake reuses (20 - 1) // 4 * 4 = 16
    first = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2}).json()
    second = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2}).json()
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": 16}
    assert second["choices"][0]["text"] == first["choices"][0]["text"]


def test_completion_stream_framing_and_text_equal_to_json(client):
    request = {"prompt": "hello", "max_tokens": 6}
    chunks, _ = stream(client, "/v1/completions", request)
    whole = client.post("/v1/completions", json=request).json()
    assert len(chunks) == 6
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 5 + ["length"]
    assert all(c["object"] == "text_completion" and c["usage"] is None for c in chunks)
    assert len({c["id"] for c in chunks}) == 1


def test_completion_stream_include_usage_sends_final_usage_chunk(client):
    body = {"prompt": "hello", "max_tokens": 3, "stream_options": {"include_usage": True}}
    chunks, _ = stream(client, "/v1/completions", body)
    assert len(chunks) == 4
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                                   "prompt_tokens_details": {"cached_tokens": 0}}


def test_chat_json_uses_chat_template(client, engine):
    body = client.post("/v1/chat/completions", json={"messages": messages(), "max_tokens": 4}).json()
    prompt_ids = engine.tokenizer.encode(CHAT_PROMPT)
    assert engine.requests[-1].prompt_token_ids == prompt_ids
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-")
    expected = engine.expected_text(prompt_ids, 4)
    assert body["choices"][0]["message"] == {"role": "assistant", "content": expected}
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)


def test_chat_stream_role_first_then_deltas_equal_to_json(client):
    request = {"messages": messages(), "max_completion_tokens": 4}
    chunks, _ = stream(client, "/v1/chat/completions", {**request, "stream_options": {"include_usage": True}})
    whole = client.post("/v1/chat/completions", json=request).json()
    deltas = [c["choices"][0]["delta"] for c in chunks[:-1]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert all(set(d) == {"content"} for d in deltas[1:])
    assert "".join(d["content"] for d in deltas) == whole["choices"][0]["message"]["content"]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None] * 4 + ["length"]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4


def test_chat_text_parts_are_joined(client, engine):
    parts = [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]
    body = {"messages": [{"role": "user", "content": parts}], "max_tokens": 1}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    assert engine.requests[-1].prompt_token_ids == engine.tokenizer.encode("<|user|>hi\n<|assistant|>")


def test_token_id_prompts_are_passed_as_is(client, engine):
    for prompt in ([104, 105, 33], [[104, 105, 33]]):
        assert client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}).status_code == 200
        assert engine.requests[-1].prompt_token_ids == [104, 105, 33]


def test_sampling_fields_map_to_engine_params(client, engine):
    body = {"prompt": "hi", "max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 20, "seed": 42,
            "stop": ["\n", "END"], "stop_token_ids": [2, 3], "min_tokens": 2, "ignore_eos": True}
    assert client.post("/v1/completions", json=body).status_code == 200
    assert engine.requests[-1].sampling == SamplingParams(
        max_tokens=7, temperature=0.5, top_p=0.9, top_k=20, seed=42, stop=("\n", "END"),
        stop_token_ids=(2, 3), min_tokens=2, ignore_eos=True)
    assert engine.requests[-1].disagg is None
    assert client.post("/v1/completions", json={"prompt": "hi", "stop": "x"}).status_code == 200
    assert engine.requests[-1].sampling == SamplingParams(max_tokens=16, stop=("x",))


def test_default_max_tokens(client, engine):
    client.post("/v1/completions", json={"prompt": "x" * 120})  # 16 by default, clamped to the room left
    assert engine.requests[-1].sampling.max_tokens == 8
    client.post("/v1/chat/completions", json={"messages": messages()})  # chat: up to the context length
    assert engine.requests[-1].sampling.max_tokens == MAX_SEQ_LEN - len(engine.tokenizer.encode(CHAT_PROMPT))
    body = {"messages": messages(), "max_tokens": 9, "max_completion_tokens": 3}
    client.post("/v1/chat/completions", json=body)
    assert engine.requests[-1].sampling.max_tokens == 3


def test_context_only_request_returns_disaggregated_params(client, engine):
    body = {"prompt": "hello", "max_tokens": 8, "disaggregated_params": {"request_type": "context_only"}}
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    prompt_ids = engine.tokenizer.encode("hello")
    request_id = engine.requests[-1].request_id
    assert engine.requests[-1].disagg == DisaggParams("context_only")
    assert choice["text"] == engine.expected_text(prompt_ids, 1)
    assert choice["disaggregated_params"] == {
        "request_type": "context_only", "ctx_request_id": f"ctx-{request_id}",
        "ctx_endpoint": "tcp://127.0.0.1:5555", "ctx_epoch": "epoch-1",
        "first_gen_tokens": engine.tokenizer.encode(choice["text"]), "prompt_token_ids": prompt_ids,
        "ctx_cached_tokens": 0, "cache_salt": None}


def test_generation_only_request_uses_the_context_prompt_ids(client, engine):
    params = {"request_type": "generation_only", "ctx_request_id": 1234, "ctx_endpoint": "tcp://h:1",
              "ctx_epoch": "e7", "first_gen_tokens": [120], "prompt_token_ids": [104, 105],
              "ctx_cached_tokens": 4, "opaque_state": None}
    body = {"messages": messages(), "max_tokens": 3, "disaggregated_params": params}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    request = engine.requests[-1]
    assert request.prompt_token_ids == [104, 105]
    assert request.disagg == DisaggParams(
        "generation_only", ctx_request_id="1234", ctx_endpoint="tcp://h:1", ctx_epoch="e7",
        first_gen_tokens=(120,), prompt_token_ids=(104, 105), ctx_cached_tokens=4)


def test_stream_skips_outputs_without_text(client):
    chunks, _ = stream(client, "/v1/completions", {"prompt": "UTF8", "max_tokens": 2})
    assert [c["choices"][0]["text"] for c in chunks] == ["é"]
    assert client.post("/v1/completions", json={"prompt": "UTF8", "max_tokens": 2}).json()["choices"][0][
        "text"] == "é"


def test_engine_error_mid_stream_sends_error_event_then_done(client, engine):
    chunks, raw = stream(client, "/v1/completions", {"prompt": "FAILMID", "max_tokens": 5,
                                                     "stream_options": {"include_usage": True}})
    prompt_ids = engine.tokenizer.encode("FAILMID")
    assert [c["choices"][0]["text"] for c in chunks[:2]] == list(engine.expected_text(prompt_ids, 2))
    assert chunks[2] == {"error": {"message": "generation leg lost", "type": "bad_gateway", "param": None,
                                   "code": "engine_error"}}
    assert len(chunks) == 3  # no usage chunk after an error
    assert engine.aborted == []  # the engine ended the request itself


def test_models_lists_the_served_model(client):
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    assert [(m["id"], m["object"], m["owned_by"], m["max_model_len"]) for m in body["data"]] == [
        ("fake-model", "model", "pdserve", MAX_SEQ_LEN)]
    assert client.get("/v1/models/fake-model").json()["id"] == "fake-model"
    health = client.get("/health").json()
    assert health == {"status": "ok", "model": "fake-model", "epoch": health["epoch"]}
    assert re.fullmatch(r"[0-9a-f]{32}", health["epoch"])  # the process's epoch: the same on every call
    assert client.get("/health").json()["epoch"] == health["epoch"]


def test_engine_factory_may_be_an_async_context_manager():
    from contextlib import asynccontextmanager

    events = []

    @asynccontextmanager
    async def factory():
        events.append("start")
        yield FakeEngine()
        events.append("stop")

    with TestClient(create_app(factory)) as client:
        assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200
        assert events == ["start"]
    assert events == ["start", "stop"]


def test_dependency_override_swaps_the_engine():
    from server.api.deps import get_engine, get_ready_engine

    started, swapped = FakeEngine(model_name="started"), FakeEngine(model_name="swapped")
    app = create_app(lambda: started)
    app.dependency_overrides[get_engine] = lambda: swapped
    app.dependency_overrides[get_ready_engine] = lambda: swapped
    with TestClient(app) as client:
        body = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).json()
        assert body["model"] == "swapped"
    assert (len(started.requests), len(swapped.requests)) == (0, 1)


CONTINUED = {"request_type": "generation_only", "ctx_request_id": "cmpl-c1", "ctx_endpoint": "tcp://127.0.0.1:1",
             "ctx_epoch": "e", "first_gen_tokens": [5], "first_text_streamed": True}


def test_first_text_streamed_is_refused_outside_a_streamed_generation_only_request(client, engine):
    before = len(engine.requests)
    for body in ({"prompt": "hi", "max_tokens": 3, "disaggregated_params": CONTINUED},  # not streamed
                 {"prompt": "hi", "max_tokens": 3, "stream": True,
                  "disaggregated_params": {**CONTINUED, "request_type": "context_and_generation"}}):
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "disaggregated_params.first_text_streamed"
    assert len(engine.requests) == before  # nothing reached the engine


def test_a_continued_stream_uses_the_derived_id_and_sends_no_second_role_chunk(client):
    from server.openai.formatting import continued_response_id

    events, _ = stream(client, "/v1/chat/completions",
                       {"messages": messages(), "max_tokens": 3, "disaggregated_params": CONTINUED})
    assert {e["id"] for e in events} == {continued_response_id("cmpl-c1")}
    assert all("role" not in e["choices"][0]["delta"] for e in events if e["choices"])
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])


def test_text_folded_into_a_failure_is_streamed_before_the_error():
    """Outputs that queued up behind a busy consumer are folded into one; if the last is a failure,
    the text of the ones before it still reaches the client, then the error event."""
    from server.types import RequestOutput

    class FoldingEngine(FakeEngine):
        async def generate(self, request):
            self.requests.append(request)
            yield RequestOutput(request.request_id, [5], "ab", finished=False, prompt_tokens=1, completion_tokens=1)
            yield RequestOutput(request.request_id, [6], "cd", finished=True, finish_reason="error",
                                prompt_tokens=1, completion_tokens=2, error="generation leg lost", error_code=502)

    with TestClient(create_app(FoldingEngine)) as folding:
        response = folding.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "stream": True})
    events = [json.loads(e) for e in sse_events(response.text)[:-1]]
    assert [e["choices"][0]["text"] for e in events[:-1]] == ["ab", "cd"]
    assert events[-1]["error"]["message"] == "generation leg lost"
