"""Every bad input gets its 4xx (or engine 5xx) in OpenAI's error shape, and the server keeps serving.

Wrong types are answered with 400 (not 422), as OpenAI and vLLM do; the message names the field.
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from test_api_engine_fake import TOKEN, FakeEngine, deployment_app

from server.api.app import create_app

MAX_SEQ_LEN = 128  # the fake tokenizer is byte-level: one token per ASCII character


@pytest.fixture(scope="module")
def engine() -> FakeEngine:
    return FakeEngine(max_seq_len=MAX_SEQ_LEN)


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(deployment_app(lambda: engine), headers={"x-pdserve-token": TOKEN}) as c:
        yield c


def chat(content: str = "hi", **extra) -> dict:
    return {"messages": [{"role": "user", "content": content}], **extra}


GOOD_COMPLETION = {"prompt": "hello", "max_tokens": 3}

# (route, body, status, param, message fragment)
BAD_REQUESTS = [
    ("/v1/completions", {"prompt": ""}, 400, "prompt", "must not be empty"),
    ("/v1/completions", {"prompt": []}, 400, "prompt", "must not be empty"),
    ("/v1/completions", {"prompt": "x" * 200}, 400, "prompt", "maximum context length is 128"),
    ("/v1/completions", {"prompt": "x" * 128, "max_tokens": 1}, 400, "prompt", "no room to generate"),
    ("/v1/completions", {"prompt": "x" * 100, "max_tokens": 29}, 400, "max_tokens", "you requested 129"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "0 is only for echo"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -3}, 400, "max_tokens", "equal to 0"),
    ("/v1/completions", {"prompt": "hi", "temperature": -0.5}, 400, "temperature", "equal to 0"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p", "greater than 0"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p", "less than or equal to 1"),
    ("/v1/completions", {"prompt": "hi", "n": 17}, 400, "n", "17 choices asked; this server's maximum is 16"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n", "greater than or equal to 1"),
    ("/v1/completions", {"prompt": "hi", "top_k": -2}, 400, "top_k", "equal to -1"),
    ("/v1/completions", {"prompt": "hi", "min_tokens": 5, "max_tokens": 2}, 400, "min_tokens",
     "must not exceed max_tokens"),
    ("/v1/completions", {"prompt": [1, 2, 999]}, 400, "prompt", "token id 999"),
    ("/v1/completions", {"prompt": [-1]}, 400, "prompt", "token id -1"),
    ("/v1/completions", {"prompt": ["a", ""]}, 400, "prompt.1", "prompt.1 must not be empty"),
    ("/v1/completions", {"prompt": [[1], [2, 999]]}, 400, "prompt.1", "token id 999 in prompt.1"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt", "must be a string, a list of token ids"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens", "valid integer"),
    ("/v1/completions", {"prompt": "hi", "stream": "maybe"}, 400, "stream", "valid boolean"),
    ("/v1/completions", {"prompt": "hi", "stop": 3}, 400, "stop", "a string or a list of strings"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature", "valid number"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt", "Field required"),
    ("/v1/completions", [1, 2], 400, None, "request body: Input should be an object"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model", "model 'gpt-4' does not exist"),
    ("/v1/completions", {"prompt": "hi", "disaggregated_params": {"request_type": "sometimes"}}, 400,
     "disaggregated_params.request_type", "context_only"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", "at least 1 item"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages", "valid array"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400, "messages.0.role", "Field required"),
    ("/v1/chat/completions", chat("x" * 200), 400, "messages", "maximum context length is 128"),
    ("/v1/chat/completions", chat(max_completion_tokens=0), 400, "max_completion_tokens", "equal to 1"),
    ("/v1/chat/completions", chat(max_tokens=500), 400, "max_tokens", "maximum context length"),
    ("/v1/chat/completions", chat(n=17), 400, "n", "this server's maximum is 16"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages.0.content", "only text content"),
    ("/v1/chat/completions", chat(content=7), 400, "messages.0.content", "a string or a list of text parts"),
    ("/v1/chat/completions", chat(model="other"), 404, "model", "does not exist"),
]


def assert_openai_error(response, status: int, param: str | None, fragment: str) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert fragment in error["message"], error["message"]
    assert error["param"] == param
    assert error["type"] == {400: "invalid_request_error", 404: "not_found_error"}.get(status, error["type"])


def assert_serves(client: TestClient, engine: FakeEngine) -> None:
    response = client.post("/v1/completions", json=GOOD_COMPLETION)
    assert response.status_code == 200, response.text
    expected = engine.expected_text(engine.tokenizer.encode("hello"), 3)
    assert response.json()["choices"][0]["text"] == expected


@pytest.mark.parametrize(("route", "body", "status", "param", "fragment"), BAD_REQUESTS)
def test_bad_request_gets_openai_error_and_server_keeps_serving(client, engine, route, body, status, param,
                                                                 fragment):
    assert_openai_error(client.post(route, json=body), status, param, fragment)
    assert_serves(client, engine)


@pytest.mark.parametrize("stream", [False, True])
def test_bad_request_when_streaming_is_still_a_json_error(client, engine, stream):
    response = client.post("/v1/completions", json={"prompt": "", "stream": stream})
    assert_openai_error(response, 400, "prompt", "must not be empty")
    assert response.headers["content-type"] == "application/json"
    assert_serves(client, engine)


MALFORMED = [
    (b"{bad json", "malformed JSON body: key must be a string at line 1 column 2"),
    (b'{"prompt": "hi",}', "malformed JSON body: trailing comma at line 1 column 17"),
    (b"", "the request body is empty: send a JSON object"),
    (b"null", "request body: Input should be an object"),
]


@pytest.mark.parametrize(("raw", "message"), MALFORMED)
def test_malformed_json_is_400(client, engine, raw, message):
    response = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert response.json() == {"error": {"message": message, "type": "invalid_request_error", "param": None,
                                         "code": None}}
    assert_serves(client, engine)


def test_json_body_is_parsed_whatever_the_content_type(client, engine):
    response = client.post("/v1/completions", content=b'{"prompt": "hello", "max_tokens": 3}',
                           headers={"content-type": "application/x-www-form-urlencoded"})  # curl -d
    assert response.status_code == 200
    assert response.json()["choices"][0]["text"] == engine.expected_text(engine.tokenizer.encode("hello"), 3)


def test_unknown_route_and_wrong_method(client, engine):
    assert_openai_error(client.get("/v1/nothing"), 404, None, "route not found: GET /v1/nothing")
    assert_openai_error(client.post("/v2/completions", json={}), 404, None, "route not found")
    response = client.get("/v1/completions")
    assert response.status_code == 405
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert_openai_error(client.get("/v1/models/other-model"), 404, "model", "does not exist")
    assert_serves(client, engine)


def test_unknown_fields_are_ignored(client, engine):
    body = {**GOOD_COMPLETION, "frobnicate": 1, "logit_bias": {"5": 1}, "user": "u", "suffix": None}
    assert client.post("/v1/completions", json=body).status_code == 200
    body = chat(max_tokens=2, presence_penalty=0.5, tools=None, response_format={"type": "text"})
    assert client.post("/v1/chat/completions", json=body).status_code == 200


# (prompt word, stream, status, message fragment, error code)
ENGINE_FAILURES = [
    ("FAIL503", False, 503, "no KV from the context server", "engine_error"),
    ("FAIL503", True, 503, "no KV from the context server", "engine_error"),
    ("FAILMID", False, 502, "generation leg lost", "engine_error"),
    ("RAISE", False, 500, "engine error: RuntimeError: model runner crashed", "engine_error"),
    ("ABORTED", False, 503, "server shutting down", "aborted"),
]


@pytest.mark.parametrize(("word", "stream", "status", "fragment", "code"), ENGINE_FAILURES)
def test_engine_failure_maps_to_its_status(client, engine, word, stream, status, fragment, code):
    response = client.post("/v1/completions", json={"prompt": word, "max_tokens": 4, "stream": stream})
    assert_openai_error(response, status, None, fragment)
    assert response.json()["error"]["code"] == code
    assert response.json()["error"]["type"] == {500: "server_error", 502: "bad_gateway",
                                                503: "service_unavailable"}[status]
    assert_serves(client, engine)


def test_not_ready_engine_answers_503_until_ready():
    engine = FakeEngine(ready=False)
    with TestClient(create_app(lambda: engine)) as client:
        assert_openai_error(client.get("/health"), 503, None, "not ready")
        assert_openai_error(client.post("/v1/completions", json=GOOD_COMPLETION), 503, None, "not ready")
        assert engine.requests == []
        engine.ready = True
        assert client.get("/health").status_code == 200
        assert_serves(client, engine)
