"""Tenants and honest health on one real disaggregated deployment (`pdserve launch`, real processes on
loopback, the real `openai` client): API keys at the router, tenants isolated by their keys' salts,
equal explicit salts sharing and different ones not, a generation server that pulls nothing it
holds, the readiness probe through the pair, and — with faults injected into the real KV sender by
tests/faults/sitecustomize.py — a transfer that fails, blocks that are stranded (health turns 503,
the router fences the server) and a generation server that dies, each named by the probe.

The tests run in file order on one deployment; the last two leave it broken on purpose.
"""

from __future__ import annotations

import os
import secrets
import signal
from pathlib import Path

import deploy_harness as dh
import hf_reference
import httpx
import openai
import pytest
from transformers import AutoTokenizer
from waiting import wait_until

from server.models.builtin import resolve_model

MODEL = "builtin:tiny-llama"
TOKEN = "tenants-live-token-0123456789abcdef"
KEY_A, KEY_B = "tenant-a-key-0001", "tenant-b-key-0002"
FAULTS = Path(__file__).resolve().parents[1] / "faults"
OVERRIDES = {
    "router": {"type": "round_robin", "api_keys": [KEY_A, KEY_B], "tenant_salt_from_api_key": True},
    "cache_transceiver_config": {"auth_token": TOKEN},
    "context_servers": {"cache_transceiver_config": {"kv_transfer_timeout_ms": 5000}},
    "generation_servers": {"cache_transceiver_config": {"kv_transfer_timeout_ms": 3000}},
}
N = 32  # tokens generated: the prompt's last block fills up on the generation server


@pytest.fixture(scope="module")
def fault_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("faults")


@pytest.fixture(scope="module")
def dep(tmp_path_factory, fault_dir):
    env = {"PYTHONPATH": os.pathsep.join([str(FAULTS), os.environ.get("PYTHONPATH", "")]),
           "PDSERVE_TEST_FAULT_DIR": str(fault_dir)}
    with dh.launched("disagg.yaml", tmp_path_factory.mktemp("tenants"), OVERRIDES, env) as deployment:
        yield deployment


def _client(dep: dh.Deployment, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{dep.url}/v1", api_key=key, max_retries=0, timeout=120)


def _complete(dep: dh.Deployment, key: str, prompt: str, **extra):
    return _client(dep, key).completions.create(model=MODEL, prompt=prompt, max_tokens=N, temperature=0,
                                                extra_body={"ignore_eos": True, **extra})


def _hf_text(prompt: str) -> str:
    model_dir = resolve_model(MODEL)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return tokenizer.decode(hf_reference.hf_greedy_ignore_eos(model_dir, tokenizer.encode(prompt), N),
                            skip_special_tokens=True)


def _prompt(tag: str) -> str:
    return f"[{tag} {secrets.token_hex(4)}] The tenants of one deployment share its servers, not their caches. " * 2


def _authorised(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_the_router_needs_an_api_key_and_health_and_metrics_stay_open(dep):
    with pytest.raises(openai.AuthenticationError) as info:
        _complete(dep, "not-a-key", "hello")
    assert info.value.status_code == 401
    assert info.value.body == {"message": "invalid API key", "type": "authentication_error", "param": None,
                               "code": "invalid_api_key"}
    missing = httpx.post(f"{dep.url}/v1/completions", json={"prompt": "hello"}, timeout=10)
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "missing_api_key"
    assert httpx.get(f"{dep.url}/v1/models", timeout=10).status_code == 401
    assert httpx.get(f"{dep.url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{dep.url}/metrics", timeout=10).status_code == 200
    assert _complete(dep, KEY_A, "hello").usage.completion_tokens == N


def test_tenants_are_isolated_by_their_keys_and_explicit_salts_share_only_when_equal(dep):
    prompt = _prompt("isolation")
    want = _hf_text(prompt)
    gen = dep.generation_urls[0]
    pulled = lambda: dep.metric(gen, "pdserve_kv_transfer_bytes_total")
    gen_hits = lambda: dep.metric(gen, "pdserve_prefix_cache_hit_tokens_total")

    def run(key: str, **extra) -> tuple[int, float, float]:
        """(cached tokens reported, bytes the generation server pulled, its local prefix hit)"""
        bytes_before, hits_before = pulled(), gen_hits()
        answer = _complete(dep, key, prompt, **extra)
        assert answer.choices[0].text == want
        return answer.usage.prompt_tokens_details.cached_tokens, pulled() - bytes_before, gen_hits() - hits_before

    cached, nbytes, hit = run(KEY_A)
    assert cached == 0 and nbytes > 0 and hit == 0
    cached, again, hit = run(KEY_A)  # the same tenant reuses its prefix on both servers
    assert cached > 0 and hit > 0
    assert again == 0  # the generation server holds the whole prompt: it pulls nothing
    assert run(KEY_B) == (0, nbytes, 0)  # another tenant: nothing reused, everything pulled
    assert run(KEY_B)[0] > 0
    assert run(KEY_A, cache_salt="project-x")[0] == 0  # a salt of its own: a namespace of its own
    assert run(KEY_A, cache_salt="project-x")[0] > 0  # equal salts share
    assert run(KEY_A, cache_salt="project-y")[0] == 0  # different salts do not
    assert run(KEY_B, cache_salt="project-x")[0] == 0  # B's "project-x" is not A's
    raw = httpx.post(f"{dep.url}/v1/completions", headers=_authorised(KEY_A), timeout=120,
                     json={"prompt": prompt, "max_tokens": 2, "temperature": 0})
    assert raw.status_code == 200 and "cache_salt" not in raw.text  # the tenant's salt stays inside


def test_readiness_probe_runs_one_request_through_the_pair(dep):
    assert httpx.get(f"{dep.url}/health_generate", timeout=60).status_code == 401
    gen = dep.generation_urls[0]
    before = dep.metric(gen, "pdserve_kv_transfer_bytes_total")
    probe = httpx.get(f"{dep.url}/health_generate", headers=_authorised(KEY_A), timeout=90)
    assert probe.status_code == 200, probe.text
    body = probe.json()
    assert (body["status"], body["context"], body["generation"]) == ("ok", dep.context_urls[0], gen)
    assert dep.metric(gen, "pdserve_kv_transfer_bytes_total") > before  # a real transfer
    for url, role in ((dep.context_urls[0], "context"), (gen, "generation")):
        alone = httpx.get(f"{url}/health_generate", timeout=60)
        assert alone.status_code == 200 and alone.json()["leg"] == role
    router = dep.metric(dep.url, "pdserve_router_leg_latency_seconds_count", 'leg="context"')
    assert router > 0 and dep.metric(dep.url, "pdserve_router_leg_latency_seconds_count", 'leg="generation"') > 0
    ctx = dep.context_urls[0]
    assert dep.metric(ctx, "pdserve_prompt_tokens_total") > 0
    assert dep.metric(ctx, "pdserve_e2e_request_latency_seconds_count") > 0
    assert dep.metric(gen, "pdserve_request_queue_time_seconds_count") > 0
    assert dep.metric(gen, "pdserve_num_preemptions_total") == 0


def test_readiness_probe_names_a_failed_transfer(dep, fault_dir):
    (fault_dir / "drop_pulls").touch()  # the context server ignores pulls: they time out
    try:
        probe = httpx.get(f"{dep.url}/health_generate", headers=_authorised(KEY_A), timeout=90)
    finally:
        (fault_dir / "drop_pulls").unlink()
    assert probe.status_code == 503, probe.text
    body = probe.json()
    assert (body["leg"], body["server"]) == ("transfer", dep.generation_urls[0])
    assert "KV transfer from the context server failed" in body["error"], body
    assert "did not finish within 3000 ms" in body["error"], body
    assert httpx.get(f"{dep.url}/health_generate", headers=_authorised(KEY_A), timeout=90).status_code == 200


def _router_view(dep: dh.Deployment, url: str) -> dict:
    return httpx.get(f"{dep.url}/health", timeout=10).json()["servers"][url]


def test_stranded_blocks_turn_health_503_and_the_router_fences_the_server(dep, fault_dir):
    ctx = dep.context_urls[0]
    assert httpx.get(f"{ctx}/health", timeout=10).status_code == 200
    (fault_dir / "suppress_unpin").touch()  # every lease that ends now leaves its pins behind
    _complete(dep, KEY_A, _prompt("stranded"))
    wait_until(lambda: httpx.get(f"{ctx}/health", timeout=10).status_code == 503, 30,
               what="the context server reports the stranded blocks")
    body = httpx.get(f"{ctx}/health", timeout=10).json()
    assert body["status"] == "unhealthy"
    assert body["reason"].startswith("stranded_pins: window 2048: ") and "held by no live lease" in body["reason"]
    wait_until(lambda: not _router_view(dep, ctx)["healthy"], 15, what="the router fences the context server")
    assert "stranded_pins" in _router_view(dep, ctx)["last_error"]
    probe = httpx.get(f"{dep.url}/health_generate", headers=_authorised(KEY_A), timeout=90)
    assert probe.status_code == 503 and probe.json()["leg"] == "context", probe.text


def test_readiness_probe_names_a_dead_generation_server(dep):
    gen = dep.generation_urls[0]
    [pid] = dep.server_pids("generation")
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not _router_view(dep, gen)["healthy"], 15, what="the router fences the generation server")
    probe = httpx.get(f"{dep.url}/health_generate", headers=_authorised(KEY_B), timeout=90)
    assert probe.status_code == 503, probe.text
    assert probe.json()["leg"] == "generation"
