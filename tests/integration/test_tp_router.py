"""A tensor-parallel deployment behind the router, driven by the real `openai` client.

One context server and two generation servers, each of two ranks (TP=2 on both sides: the
one-to-one path per rank pair), kv_cache_aware routing fed by the servers' KV events, a small
context pool with a host tier. In order, on the one deployment of the module:
1. completions and chat, streamed and not, equal transformers / each other;
2. the prefix cache and the host tier serve repeats (and only under equal `cache_salt`s);
3. the router's KV index hears every server's events;
4. a stream whose generation server is SIGKILLed moves to the other one, text unchanged;
5. a context server rank SIGKILLed: the server exits (code 3) and `pdserve launch` restarts it as a
   whole, the router fencing it meanwhile; answers are exact again afterwards.
"""

from __future__ import annotations

import os
import signal

import deploy_harness as dh
import hf_reference
import httpx
import pytest
from deploy_harness import pid_of
from test_disagg_fault_kills import launched_with_output
from test_migration import check_moved_stream
from waiting import wait_until

from server.models.builtin import resolve_model

MODEL = "builtin:tiny-llama"
OVERRIDES = {
    "device": "cpu", "max_seq_len": 512, "max_num_tokens": 512, "max_batch_size": 8,
    "restart": {"max_quick_deaths": 3, "backoff_s": 0.2},
    "router": {"type": "kv_cache_aware", "migration_limit": 1},
    "kv_cache_config": {"tokens_per_block": 16},
    "context_servers": {"tensor_parallel_size": 2,
                        "kv_cache_config": {"max_tokens": 512, "host_cache_size": 2 << 20,
                                            "secondary_offload_min_priority": 0}},
    "generation_servers": {"num_instances": 2, "urls": ["x:1", "x:2"], "tensor_parallel_size": 2,
                           "kv_cache_config": {"max_tokens": 4096}},
}
FILLER = "Each rank holds half of the heads, and the answer must not change. "


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    with launched_with_output("disagg.yaml", tmp_path_factory.mktemp("tp-router"), OVERRIDES) as (dep, out):
        yield dep, out


@pytest.fixture(scope="module")
def client(deployment):
    return dh.openai_client(deployment[0].url)


def _hf(prompt: str, n: int) -> str:
    return hf_reference.hf_text_ignore_eos(resolve_model(MODEL), prompt, n)


def _text(client, prompt: str, salt: str | None = None) -> tuple[str, int]:
    extra = {"ignore_eos": True, **({"cache_salt": salt} if salt else {})}
    answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, extra_body=extra)
    return answer.choices[0].text, answer.usage.prompt_tokens_details.cached_tokens


def test_completions_and_chat_through_tp_servers(client):
    dh.check_answers_and_streams(client, MODEL, "Topic: lamps. " + FILLER * 3, 16, "What do the ranks hold?")


def test_prefix_cache_host_tier_and_cache_salt(client, deployment):
    dep, _ = deployment
    first = "Topic: maps. " + FILLER * 4
    text, cached = _text(client, first, "tenant-a")
    assert cached == 0 and text == _hf(first, 10)
    assert _text(client, first, "tenant-b")[1] == 0
    for topic in ("clocks", "ships", "roads", "bells", "coins"):  # past the 32-block context pool
        _text(client, f"Topic: {topic}. " + FILLER * 4)
    text, cached = _text(client, first, "tenant-a")
    assert cached > 0 and text == _hf(first, 10)
    ctx = dep.context_urls[0]
    assert dep.metric(ctx, "pdserve_kv_offloaded_blocks_total") > 0
    assert dep.metric(ctx, "pdserve_kv_onboarded_blocks_total") > 0


def test_the_router_hears_every_servers_kv_events(deployment):
    dep, _ = deployment
    text = httpx.get(f"{dep.url}/metrics", timeout=10).text
    live = [line for line in text.splitlines() if line.startswith("pdserve_router_kv_feed_live{")]
    assert len(live) == 3 and all(line.endswith(" 1.0") for line in live), live
    assert dep.metric(dep.url, "pdserve_router_kv_events_total") > 0


def test_a_stream_moves_off_a_killed_tp_generation_server(deployment):
    dep, _ = deployment
    check_moved_stream(dep, chat=False, moves_before=dep.metric(dep.url, "pdserve_router_migrations_total"))
    wait_until(lambda: _all_healthy(dep), 90, what="the killed generation server back and unfenced")


def test_a_killed_rank_restarts_its_whole_server_and_the_router_fences_it(client, deployment):
    dep, out = deployment
    prompt = "Topic: kites. " + FILLER * 2
    reference = _text(client, prompt)[0]
    server = pid_of(dep, "context-0")
    [rank1] = dh.children_running(server, "spawn_main")
    os.kill(rank1.pid, signal.SIGKILL)
    wait_until(lambda: "context-0 exited with exit code 3" in out.read_text(), 20, what="the server's exit")
    wait_until(lambda: not _all_healthy(dep), 10, what="the router fences the context server")
    wait_until(lambda: _all_healthy(dep), 90, what="the context server restarted and unfenced")
    assert pid_of(dep, "context-0") != server
    assert _text(client, prompt)[0] == reference == _hf(prompt, 10)


def _all_healthy(dep: dh.Deployment) -> bool:
    response = httpx.get(dep.url + "/health", timeout=5)
    return response.status_code == 200 and all(s["healthy"] for s in response.json()["servers"].values())
