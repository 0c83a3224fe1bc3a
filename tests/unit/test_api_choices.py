"""n choices and several prompts through the HTTP layer (OpenAI's numbering, interleaved SSE, usage),
and the disaggregation legs' log-probabilities: a generation leg answers what an aggregated server does."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from test_api_engine_fake import TOKEN, FakeEngine, KnownEndpoints, deployment_app, sse_chunks, sse_events

CTX_ENDPOINT = "tcp://127.0.0.1:5555"  # the fake's context server


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine(max_seq_len=256)


@pytest.fixture
def client(engine):
    app = deployment_app(lambda: engine, KnownEndpoints(frozenset({CTX_ENDPOINT})))
    with TestClient(app, headers={"x-pdserve-token": TOKEN}) as c:
        yield c


def test_several_prompts_and_n_choices_are_numbered_prompt_by_prompt(client, engine):
    prompts = ["ab", "xyz"]
    body = client.post("/v1/completions", json={"prompt": prompts, "n": 3, "max_tokens": 4}).json()
    Completion.model_validate(body)
    ids = [engine.tokenizer.encode(p) for p in prompts]
    assert [(c["index"], c["text"]) for c in body["choices"]] == [
        (p * 3 + c, engine.expected_text(ids[p], 4, c)) for p in range(2) for c in range(3)]
    assert [r.sampling.n for r in engine.requests] == [3, 3]  # one engine request per prompt, forked there
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 24, "total_tokens": 29,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_streamed_choices_interleave_and_add_up_to_the_whole_answer(client, engine):
    request = {"prompt": [[5, 6], [7]], "n": 2, "max_tokens": 3}
    whole = client.post("/v1/completions", json=request).json()
    chunks = sse_chunks(client.post("/v1/completions", json={**request, "stream": True,
                                                         "stream_options": {"include_usage": True}}))
    indices = [c["choices"][0]["index"] for c in chunks[:-1]]
    assert sorted(set(indices)) == [0, 1, 2, 3] and indices != sorted(indices)  # interleaved
    texts = {i: "".join(c["choices"][0]["text"] for c in chunks[:-1] if c["choices"][0]["index"] == i)
             for i in range(4)}
    assert [texts[c["index"]] for c in whole["choices"]] == [c["text"] for c in whole["choices"]]
    finals = [c["choices"][0]["index"] for c in chunks[:-1] if c["choices"][0]["finish_reason"] == "length"]
    assert sorted(finals) == [0, 1, 2, 3]  # each choice ends once
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    assert whole["usage"]["prompt_tokens"] == 3 and whole["usage"]["completion_tokens"] == 12


def test_chat_n_choices_json_and_stream(client, engine):
    request = {"messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 3}
    body = client.post("/v1/chat/completions", json=request).json()
    ChatCompletion.model_validate(body)
    prompt = engine.requests[-1].prompt_token_ids
    assert [c["message"]["content"] for c in body["choices"]] == [engine.expected_text(prompt, 3, c) for c in (0, 1)]
    assert body["usage"]["prompt_tokens"] == len(prompt) and body["usage"]["completion_tokens"] == 6
    chunks = sse_chunks(client.post("/v1/chat/completions", json={**request, "stream": True}))
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk)
    roles = [c["choices"][0]["index"] for c in chunks if "role" in c["choices"][0]["delta"]]
    assert roles == [0, 1]  # each choice's first chunk carries the role
    for choice in body["choices"]:
        deltas = [c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"][0]["index"] ==
                  choice["index"]]
        assert "".join(deltas) == choice["message"]["content"]


def test_context_and_generation_legs_carry_one_prompt(client, engine):
    params = {"request_type": "context_only"}
    response = client.post("/v1/completions", json={"prompt": ["a", "b"], "disaggregated_params": params})
    assert response.status_code == 400
    assert response.json()["error"] == {"message": "'prompt': a context_only request carries one prompt, not 2",
                                        "type": "invalid_request_error", "param": "prompt", "code": None}
    assert engine.requests == []


def legs_request(extra: dict | None = None) -> dict:
    return {"prompt": "abc", "n": 2, "max_tokens": 4, "logprobs": 2, "echo": True, **(extra or {})}


def test_context_answer_carries_the_logprobs_the_generation_leg_needs(client, engine):
    ctx = client.post("/v1/completions", json=legs_request({"disaggregated_params": {
        "request_type": "context_only"}})).json()
    params = ctx["choices"][0]["disaggregated_params"]
    prompt_ids = engine.tokenizer.encode("abc")
    firsts = [engine.tokenizer.encode(engine.expected_text(prompt_ids, 1, c))[0] for c in (0, 1)]
    assert params["first_gen_tokens"] == firsts  # one per choice
    assert params["first_gen_logprobs"] == [
        [t, engine.logprob(t, 0, c, 2).logprob, [list(p) for p in engine.logprob(t, 0, c, 2).top]]
        for c, t in enumerate(firsts)]
    expected_prompt = [engine.prompt_logprob(t, j, 2) for j, t in enumerate(prompt_ids)]
    assert params["prompt_logprobs"] == [None] + [[e.token_id, e.logprob, [list(p) for p in e.top]]
                                                  for e in expected_prompt[1:]]
    plain = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2, "disaggregated_params": {
        "request_type": "context_only"}}).json()
    assert set(plain["choices"][0]["disaggregated_params"]) == {  # nothing asked, nothing added
        "request_type", "ctx_request_id", "ctx_endpoint", "ctx_epoch", "first_gen_tokens", "prompt_token_ids",
        "ctx_cached_tokens", "cache_salt"}


def test_a_generation_leg_answers_what_the_aggregated_server_does(client, engine):
    ctx = client.post("/v1/completions", json=legs_request({"disaggregated_params": {
        "request_type": "context_only"}})).json()
    params = {**ctx["choices"][0]["disaggregated_params"], "request_type": "generation_only"}
    gen = client.post("/v1/completions", json=legs_request({"disaggregated_params": params})).json()
    aggregated = client.post("/v1/completions", json=legs_request()).json()
    assert engine.requests[-2].sampling.prompt_logprobs is None  # the context server computed them
    assert [(c["index"], c["text"], c["logprobs"]) for c in gen["choices"]] == [
        (c["index"], c["text"], c["logprobs"]) for c in aggregated["choices"]]
    assert gen["choices"][1]["logprobs"]["token_logprobs"][3] == engine.logprob(
        params["first_gen_tokens"][1], 0, 1, 2).logprob
    for stream_extra in ({"stream": True},):
        chunks = sse_chunks(client.post("/v1/completions", json=legs_request({"disaggregated_params": params,
                                                                          **stream_extra})))
        for choice in aggregated["choices"]:
            mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == choice["index"]]
            assert [t for c in mine for t in c["logprobs"]["token_logprobs"]] == choice["logprobs"]["token_logprobs"]


def test_a_generation_leg_without_the_context_logprobs_is_refused(client, engine):
    ctx = client.post("/v1/completions", json=legs_request({"disaggregated_params": {
        "request_type": "context_only"}})).json()
    params = {**ctx["choices"][0]["disaggregated_params"], "request_type": "generation_only"}
    for missing, param in (("first_gen_logprobs", "disaggregated_params.first_gen_logprobs"),
                           ("prompt_logprobs", "disaggregated_params.prompt_logprobs")):
        response = client.post("/v1/completions", json=legs_request({"disaggregated_params": {
            k: v for k, v in params.items() if k != missing}}))
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param


def test_a_continued_stream_leaves_out_what_the_router_sent(client, engine):
    ctx = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3, "logprobs": 1,
                                               "disaggregated_params": {"request_type": "context_only"}}).json()
    params = {**ctx["choices"][0]["disaggregated_params"], "request_type": "generation_only",
              "first_text_streamed": True, "report_tokens": True}
    response = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3, "logprobs": 1, "stream": True,
                                                    "disaggregated_params": params})
    assert response.status_code == 200
    prompt_ids = engine.tokenizer.encode("abc")
    text = engine.expected_text(prompt_ids, 3)
    ids = [engine.tokenizer.encode(ch)[0] for ch in text]
    assert ": tokens \n" not in response.text
    assert [line for line in response.text.split("\n") if line.startswith(": tokens")] == [
        f": tokens {ids[1]}", f": tokens {ids[2]} final"]  # the first token is the router's
    chunks = [json.loads(e) for e in sse_events("".join(
        line + "\n" for line in response.text.split("\n") if not line.startswith(":")).replace("\n\n\n", "\n\n"))[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == text[1:]
    assert [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]] == list(text[1:])
