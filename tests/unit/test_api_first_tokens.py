"""A generation_only request carries one first token per choice (`first_gen_tokens[i]` is choice
i's, TensorRT-LLM's per-beam meaning): any other count is a 400 naming the field."""

from __future__ import annotations

from fastapi.testclient import TestClient
from test_api_engine_fake import TOKEN, FakeEngine, deployment_app


def test_first_gen_tokens_count_the_choices():
    engine = FakeEngine()
    params = {"request_type": "generation_only", "ctx_request_id": "c", "ctx_endpoint": "tcp://h:1",
              "ctx_epoch": "e", "prompt_token_ids": [1, 2, 3], "first_gen_tokens": [5, 6]}
    with TestClient(deployment_app(lambda: engine)) as client:
        bad = client.post("/v1/completions", headers={"x-pdserve-token": TOKEN},
                          json={"prompt": "hi", "max_tokens": 2, "disaggregated_params": params})
        assert bad.status_code == 400, bad.text
        error = bad.json()["error"]
        assert error["param"] == "disaggregated_params.first_gen_tokens"
        assert "holds 2 tokens" in error["message"] and "(n=1)" in error["message"]
        params["first_gen_tokens"] = [5]
        ok = client.post("/v1/completions", headers={"x-pdserve-token": TOKEN},
                         json={"prompt": "hi", "max_tokens": 2, "disaggregated_params": params})
        assert ok.status_code == 200, ok.text
    assert [r.disagg.first_gen_tokens for r in engine.requests] == [(5,)]
