"""Routing that knows the cache, on one real 2 + 2 deployment (tiny-llama, CPU) shared by the module:

- its router (kv_cache_aware, fed by the servers' KV events) sends a request that follows another
  with the same prefix to the context server holding it: >= 90% of the repeats report cached tokens;
- a second router process in front of the same four servers, with conditional disaggregation, has a
  generation server serve short prompts, and prompts whose prefix it holds, alone: the text equals
  transformers' and the disaggregated path's, token for token, and its metrics count what went local.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import deploy_harness as dh
import hf_reference
import httpx
import pytest
import yaml
from transformers import AutoTokenizer
from waiting import wait_until

from pdserve_bench.launch import wait_for_health
from server.models.builtin import resolve_model

MODEL = "builtin:tiny-llama"
TOKEN = "routing-live-test-token-0123456789"
CONDITIONAL = {"max_local_prefill_length": 40, "min_prefix_hit": 64}
TOPICS = ("maps", "clocks", "lamps", "ships", "roads", "bells", "coins", "doors", "farms", "kites")
FILLER = "Every answer should be short, plain and correct, and it should name the facts it relies on. "


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("routing")
    overrides = {"router": {"type": "kv_cache_aware"}, "cache_transceiver_config": {"auth_token": TOKEN}}
    with dh.launched("disagg_2x2.yaml", tmp, overrides) as dep:
        conditional = _second_router(dep, tmp, {"type": "kv_cache_aware", "conditional": CONDITIONAL})
        try:
            yield dep, conditional
        finally:
            conditional[1].terminate()
            conditional[1].wait(30)


def _second_router(dep: dh.Deployment, tmp: Path, router: dict) -> tuple[str, subprocess.Popen]:
    """Another router process (its own YAML: same servers, another port and router section)."""
    cfg = {**dep.config, "router": router, "port": dh.free_port()}
    path = tmp / "second-router.yaml"
    path.write_text(yaml.safe_dump(cfg))
    log = open(tmp / "second-router.log", "w")  # noqa: SIM115 (closed with the process)
    process = subprocess.Popen([sys.executable, "-m", "server.cli", "router", "--config", str(path)],
                               cwd=dh.ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{cfg['port']}"
    if not wait_for_health(url, dh.STARTUP_TIMEOUT_S, lambda: process.poll() is None, interval_s=0.3):
        process.kill()
        raise AssertionError((tmp / "second-router.log").read_text())
    wait_until(lambda: _feeds_live(url), 60, what="the second router's KV feeds are live")
    return url, process


def _feeds_live(url: str) -> bool:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return text.count("pdserve_router_kv_feed_live{") == 4 and all(
        line.endswith(" 1.0") for line in text.splitlines() if line.startswith("pdserve_router_kv_feed_live{"))


def _complete(url: str, prompt: str, n: int = 8, **extra) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, **extra}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def _hf_text(prompt: str, n: int) -> str:
    model_dir = resolve_model(MODEL)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return tokenizer.decode(hf_reference.hf_greedy_ignore_eos(model_dir, tokenizer.encode(prompt), n),
                            skip_special_tokens=True)


def _cached(answer: dict) -> int:
    return (answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def test_a_request_after_another_with_the_same_prefix_lands_where_the_prefix_is(deployment):
    dep, _ = deployment
    wait_until(lambda: _feeds_live(dep.url), 60, what="the router's KV feeds are live")
    repeats = []
    for topic in TOPICS:  # each prompt, then at once a longer one that starts with it (a chat's next turn)
        first = f"Topic: {topic}. " + FILLER * 2
        assert _cached(_complete(dep.url, first)) < 32  # new: nothing of it was cached anywhere
        repeats.append(_complete(dep.url, first + f"Now say more about {topic}."))
    hits = [_cached(r) for r in repeats]
    assert sum(h >= 64 for h in hits) >= 0.9 * len(hits), hits
    served = [dep.metric(u, "pdserve_prompt_tokens_total") for u in dep.context_urls]
    assert all(s > 0 for s in served), served  # new prompts were spread over both context servers
    assert dep.metric(dep.url, "pdserve_router_kv_events_total") > 0
    assert dep.metric(dep.url, "pdserve_router_kv_resyncs_total") == 0  # nothing lost on loopback
    assert [r["choices"][0]["text"] for r in repeats[:2]] == [
        _hf_text(f"Topic: {t}. " + FILLER * 2 + f"Now say more about {t}.", 8) for t in TOPICS[:2]]


def test_conditional_disaggregation_is_exact_and_counted(deployment):
    dep, (local_url, _) = deployment
    local = lambda reason: dep.metric(local_url, "pdserve_router_local_requests_total", f'reason="{reason}"')
    split = lambda: dep.metric(local_url, "pdserve_router_disaggregated_requests_total")
    gen_prefill = lambda: sum(dep.metric(u, "pdserve_prompt_tokens_total") for u in dep.generation_urls)

    short = "Name three tools."  # a few tokens: the generation server prefills it itself
    before = gen_prefill()
    answer = _complete(local_url, short, 12)
    assert answer["choices"][0]["text"] == _complete(dep.url, short, 12)["choices"][0]["text"] == _hf_text(short, 12)
    assert local("short_prefill") == 1 and split() == 0 and gen_prefill() > before
    streamed = httpx.post(f"{local_url}/v1/completions", json={
        "model": MODEL, "prompt": short, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": True},
        timeout=120)
    chunks = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert "".join(json.loads(c)["choices"][0]["text"] for c in chunks) == answer["choices"][0]["text"]
    assert local("short_prefill") == 2

    long = "Topic: harbours. " + FILLER * 3  # > 40 new tokens: disaggregated
    first = _complete(local_url, long, 12)
    assert split() == 1 and local("prefix_hit") == 0
    again = _complete(local_url, long + "And then?", 12)  # the generation server holds the prefix now
    assert local("prefix_hit") == 1 and _cached(again) >= 64
    assert first["choices"][0]["text"] == _hf_text(long, 12)
    assert again["choices"][0]["text"] == _hf_text(long + "And then?", 12)
    assert again["choices"][0]["text"] == _complete(dep.url, long + "And then?", 12)["choices"][0]["text"]
