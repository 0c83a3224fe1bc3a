"""Requests the HTTP fuzzer (pdserve_bench/fuzz.py) found answered with 500; now 400 naming the field."""

from __future__ import annotations

from fastapi.testclient import TestClient
from test_api_engine_fake import TOKEN, FakeEngine, deployment_app


def test_token_ids_outside_the_vocabulary_are_400():
    engine = FakeEngine()
    with TestClient(deployment_app(lambda: engine)) as client:
        bad = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "min_tokens": 1,
                                                    "stop_token_ids": [-404245]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "stop_token_ids", bad.text
        params = {"request_type": "generation_only", "ctx_request_id": "c", "ctx_endpoint": "tcp://h:1",
                  "ctx_epoch": "e", "first_gen_tokens": [10 ** 9]}
        bad = client.post("/v1/completions", headers={"x-pdserve-token": TOKEN},
                          json={"prompt": "hi", "max_tokens": 2, "disaggregated_params": params})
        assert bad.status_code == 400, bad.text
        assert bad.json()["error"]["param"] == "disaggregated_params.first_gen_tokens"
    assert engine.requests == []  # nothing reached the engine


def test_token_ids_are_bounded_by_the_model_vocabulary_not_the_tokenizer():
    """A model's vocabulary may be larger than its tokenizer's (padded; the 8B-shaped GPU benchmark
    model keeps a 512-token tokenizer): the generation leg must take any token the context leg sampled."""
    tokenizer_size = 258
    engine = FakeEngine(vocab_size=1000)
    params = {"request_type": "generation_only", "ctx_request_id": "c", "ctx_endpoint": "tcp://h:1",
              "ctx_epoch": "e", "prompt_token_ids": [1, 2, 700], "first_gen_tokens": [999]}
    with TestClient(deployment_app(lambda: engine)) as client:
        ok = client.post("/v1/completions", headers={"x-pdserve-token": TOKEN},
                         json={"prompt": "hi", "max_tokens": 2, "stop_token_ids": [tokenizer_size + 1],
                               "disaggregated_params": params})
        assert ok.status_code != 400, ok.text
        params["first_gen_tokens"] = [1000]
        bad = client.post("/v1/completions", headers={"x-pdserve-token": TOKEN},
                          json={"prompt": "hi", "max_tokens": 2, "disaggregated_params": params})
        assert bad.status_code == 400 and "[0, 1000)" in bad.json()["error"]["message"], bad.text
    assert [r.prompt_token_ids for r in engine.requests] == [[1, 2, 700]]


def test_extreme_top_p_and_temperature_sample_a_token():
    """top_p 5e-324 dropped every token and a tiny temperature made inf logits: NaN probabilities, 500."""
    import torch

    from server.engine.request import Request
    from server.engine.sampler import sample_on_device
    from server.types import SamplingParams

    logits = torch.tensor([[1.0, 3.0, 2.0], [1.0, 3.0, 2.0]])
    requests = [Request("a", [1], SamplingParams(temperature=1.0, top_p=5e-324, seed=1), frozenset()),
                Request("b", [1], SamplingParams(temperature=5e-324, top_p=1.0, seed=1), frozenset())]
    assert sample_on_device(logits, requests).tolist() == [1, 1]  # only the most likely token can be picked
