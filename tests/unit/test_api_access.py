"""Only the deployment drives the KV plane: the token and endpoint checks of a server's HTTP layer.

A refused request must not reach the engine (so nothing is pinned and no connection is made); the
answer is a 401/403 in OpenAI's error shape.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient
from test_api_engine_fake import TOKEN, FakeEngine, KnownEndpoints, deployment_app

from server.api.app import create_app
from server.api.routes.health import EPOCH
from server.api.routes.kv_cache import install_kv_routes
from server.auth import TOKEN_HEADER

CONTEXT_ONLY = {"prompt": "hello", "max_tokens": 4, "disaggregated_params": {"request_type": "context_only"}}
GEN_PARAMS = {"request_type": "generation_only", "ctx_request_id": "c1", "ctx_endpoint": "tcp://h:1",
              "ctx_epoch": "e", "first_gen_tokens": [120], "prompt_token_ids": [104, 105]}


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


def assert_refused(response, status: int, kind: str, *words: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == kind, error
    for word in words:
        assert word in error["message"], error


@pytest.mark.parametrize("headers", [{}, {TOKEN_HEADER: "a-wrong-token-of-enough-length"}, {TOKEN_HEADER: ""}])
def test_disaggregated_params_without_the_token_reach_nothing(engine, headers):
    with TestClient(deployment_app(lambda: engine)) as client:
        for path, body in (("/v1/completions", CONTEXT_ONLY),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                     "disaggregated_params": GEN_PARAMS})):
            assert_refused(client.post(path, json=body, headers=headers), 401, "authentication_error",
                           "disaggregated_params", TOKEN_HEADER)
    assert engine.requests == []


def test_a_server_without_a_token_refuses_disaggregated_params_even_with_a_header(engine):
    with TestClient(create_app(lambda: engine)) as client:
        response = client.post("/v1/completions", json=CONTEXT_ONLY, headers={TOKEN_HEADER: TOKEN})
    assert_refused(response, 401, "authentication_error", "has none configured")
    assert engine.requests == []


def test_plain_requests_need_no_token(engine):
    with TestClient(deployment_app(lambda: engine)) as client:
        assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    assert len(engine.requests) == 1


def test_generation_only_may_only_name_a_context_server_of_the_deployment(engine):
    directory = KnownEndpoints()
    with TestClient(deployment_app(lambda: engine, directory), headers={TOKEN_HEADER: TOKEN}) as client:
        body = {"prompt": "hi", "max_tokens": 2,
                "disaggregated_params": {**GEN_PARAMS, "ctx_endpoint": "tcp://10.1.2.3:6379"}}
        assert_refused(client.post("/v1/completions", json=body), 403, "permission_error",
                       "'tcp://10.1.2.3:6379' is not the KV endpoint of a context server of this deployment")
        assert engine.requests == []
        body["disaggregated_params"]["ctx_endpoint"] = "tcp://h:1"
        assert client.post("/v1/completions", json=body).status_code == 200
    assert directory.asked == ["tcp://10.1.2.3:6379", "tcp://h:1"]
    assert [r.disagg.ctx_endpoint for r in engine.requests] == ["tcp://h:1"]


async def _snapshot() -> dict:
    return {"hashes": ["ab"], "salt": "s", "tokens_per_block": 32, "seq": 7, "epoch": EPOCH}


def _kv_app(engine):
    engine.info = SimpleNamespace(kv_events_endpoint="tcp://127.0.0.1:5999")  # the engine's `Ready`
    engine.snapshot = _snapshot
    app = deployment_app(lambda: engine)
    install_kv_routes(app)
    return app


def test_internal_kv_routes_need_the_token(engine):
    with TestClient(_kv_app(engine)) as client:
        calls = (("GET", "/kv_cache/hashes", None), ("GET", "/kv_cache/endpoint", None),
                 ("GET", "/kv_cache/events", None), ("POST", "/kv_cache/release", {"ctx_request_id": "x"}))
        for method, path, body in calls:
            assert_refused(client.request(method, path, json=body), 401, "authentication_error", path)
        authorised = {TOKEN_HEADER: TOKEN}
        assert client.get("/kv_cache/hashes", headers=authorised).json()["hashes"] == ["ab"]
        assert client.get("/kv_cache/events", headers=authorised).json() == {"endpoint": "tcp://127.0.0.1:5999",
                                                                             "epoch": EPOCH}
        assert_refused(client.get("/kv_cache/endpoint", headers=authorised), 404, "not_found_error",
                       "no KV sender")
        assert engine.released == []
        assert client.post("/kv_cache/release", json={"ctx_request_id": "x"}, headers=authorised).status_code == 200
        assert engine.released == ["x"]
        assert_refused(client.post("/kv_cache/release", json=[1], headers=authorised), 400,
                       "invalid_request_error", "ctx_request_id")
