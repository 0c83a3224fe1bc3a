"""`cache_salt` and `kv_retention_priority` through one server's HTTP layer: checked, mapped onto the
engine's request, and a generation_only request hashing under the context server's salt."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from test_api_engine_fake import TOKEN, FakeEngine, deployment_app

GEN_PARAMS = {"request_type": "generation_only", "ctx_request_id": "c1", "ctx_endpoint": "tcp://h:1",
              "ctx_epoch": "e1", "first_gen_tokens": [120], "prompt_token_ids": [104, 105]}


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine(max_seq_len=128)


@pytest.fixture
def client(engine):
    with TestClient(deployment_app(lambda: engine), headers={"x-pdserve-token": TOKEN}) as c:
        yield c


def test_salt_and_priority_reach_the_engine(client, engine):
    assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    assert (engine.requests[-1].cache_salt, engine.requests[-1].kv_retention_priority) == (None, 35)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "cache_salt": "tenant-7",
            "kv_retention_priority": 90}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    assert (engine.requests[-1].cache_salt, engine.requests[-1].kv_retention_priority) == ("tenant-7", 90)


@pytest.mark.parametrize("extra, param, says", [
    ({"cache_salt": ""}, "cache_salt", "cache_salt must be a non-empty string if provided"),
    ({"cache_salt": 7}, "cache_salt", "Input should be a valid string"),
    ({"kv_retention_priority": 101}, "kv_retention_priority", "less than or equal to 100"),
    ({"kv_retention_priority": -1}, "kv_retention_priority", "greater than or equal to 0"),
])
def test_bad_values_are_400_naming_the_field(client, engine, extra, param, says):
    response = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, **extra})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"]
    assert engine.requests == []


def test_a_generation_leg_hashes_under_the_context_servers_salt(client, engine):
    params = {**GEN_PARAMS, "cache_salt": "tenant-7"}
    body = {"prompt": "hi", "max_tokens": 2, "disaggregated_params": params}
    assert client.post("/v1/completions", json=body).status_code == 200
    assert engine.requests[-1].cache_salt == engine.requests[-1].disagg.cache_salt == "tenant-7"
    clash = client.post("/v1/completions", json={**body, "cache_salt": "tenant-8"})
    assert clash.status_code == 400 and clash.json()["error"]["param"] == "cache_salt"
    assert len(engine.requests) == 1
