"""One real aggregated server process (`pdserve serve --config`) driven by the real `openai` client."""

from __future__ import annotations

import deploy_harness as dh
import hf_reference
import httpx
import pytest
from transformers import AutoTokenizer
from waiting import wait_until

from server.models.builtin import resolve_model

MODEL = "builtin:tiny-llama"
GREEDY = dh.GREEDY
METRICS = ["pdserve_kv_cache_blocks", "pdserve_kv_offloaded_blocks_total", "pdserve_kv_onboarded_blocks_total",
           "pdserve_prefix_cache_query_tokens_total", "pdserve_prefix_cache_hit_tokens_total", "pdserve_requests",
           "pdserve_time_to_first_token_seconds", "pdserve_time_per_output_token_seconds",
           "pdserve_generation_tokens_total"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with dh.served(tmp_path_factory.mktemp("serve"), model=MODEL) as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(server):
    return dh.openai_client(server, timeout_s=60)


def _in_use(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("pdserve_kv_cache_blocks") and 'state="in_use"' in line)


def test_completion_matches_transformers_and_reuses_prefix(client):
    model_dir = resolve_model(MODEL)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = "The quick brown fox jumps over the lazy dog. " * 5
    expected = tokenizer.decode(hf_reference.hf_greedy_ignore_eos(model_dir, tokenizer.encode(prompt), 20),
                                skip_special_tokens=True)
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, **GREEDY)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, **GREEDY)
    assert first.choices[0].text == again.choices[0].text == expected
    assert first.usage.completion_tokens == 20 and first.choices[0].finish_reason == "length"
    assert first.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_streaming_equals_whole_for_completion_and_chat(client):
    kwargs = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 16, **GREEDY}
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens
    messages = [{"role": "user", "content": "Name a colour."}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, **GREEDY)
    streamed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, stream=True, **GREEDY)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == chat.choices[0].message.content
    assert chat.choices[0].message.role == "assistant"


BAD = [
    ({"prompt": ""}, 400), ({"prompt": "hi", "max_tokens": 0}, 400), ({"prompt": "hi", "temperature": -1}, 400),
    ({"prompt": "hi", "top_p": 0}, 400), ({"prompt": "hi", "top_p": 1.5}, 400), ({"prompt": "hi", "n": 17}, 400),
    ({"prompt": "hi", "max_tokens": "ten"}, 400), ({"prompt": "x " * 600}, 400),
    ({"prompt": "hi", "max_tokens": 600}, 400),
    ({"prompt": "hi", "model": "no-such-model"}, 404),
    # a server without a deployment token takes no disaggregated_params at all (docs/SECURITY.md)
    ({"prompt": "hi", "disaggregated_params": {"request_type": "context_only"}}, 401),
    ({"prompt": "hi", "disaggregated_params": {"request_type": "generation_only"}}, 401),
]


@pytest.mark.parametrize("body, status", BAD)
def test_bad_input_is_a_4xx_json_error_and_the_server_keeps_serving(server, client, body, status):
    response = httpx.post(f"{server}/v1/completions", json=body, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and {"message", "type", "param", "code"} <= set(error)
    good = client.completions.create(model=MODEL, prompt="still alive?", max_tokens=2, **GREEDY)
    assert good.usage.completion_tokens == 2


def test_malformed_json_is_400(server):
    response = httpx.post(f"{server}/v1/completions", content=b"{not json", timeout=30)
    assert response.status_code == 400 and "error" in response.json()


def _generated(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    lines = text.splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith("pdserve_generation_tokens_total"))


def _busy(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("pdserve_requests{"))


def test_client_disconnect_aborts_and_frees_blocks(server):
    wait_until(lambda: _busy(server) == 0 and _in_use(server) == 0, 10, what="the server idle before the test")
    before = _generated(server)
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 490, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=30) as response:
        for i, _ in enumerate(response.iter_lines()):
            if i >= 6:
                break  # leave mid-stream
    # Not aborted, the request would hold its blocks to its 490th token; freed, it generates no more.
    wait_until(lambda: _in_use(server) == 0 and _busy(server) == 0, 10, what="blocks freed after the client left")
    assert _generated(server) - before < 300  # aborted, not run to its 490 tokens


def test_metrics_expose_every_required_name(server):
    missing = lambda: [name for name in METRICS if f"\n{name}" not in httpx.get(f"{server}/metrics", timeout=10).text]
    wait_until(lambda: missing() == [], 10, what="every required metric name", on_timeout=lambda: str(missing()))
