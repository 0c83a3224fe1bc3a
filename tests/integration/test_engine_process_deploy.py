"""A disaggregated deployment (`pdserve launch`, context + generation) whose servers both run their
engine in a process of its own (`engine_process: true`): the pair stays token-exact through the
router, the KV routes work (/kv_cache/endpoint, release, hashes, events), the servers' KV events
reach the router's cache index, and a SIGKILLed engine process ends its server, which the
launcher's supervisor restarts."""

from __future__ import annotations

import os
import signal

import deploy_harness as dh
import httpx
import pytest
from deploy_harness import back_again, engine_child, pid_of
from test_disagg_fault_kills import launched_with_output
from test_disagg_faults import AUTHORISED, TOKEN, complete, context_only, fresh_prompt, in_use
from waiting import wait_until

MODEL = "builtin:tiny-llama"
OVERRIDES = {"engine_process": True, "router": {"type": "kv_cache_aware"},
             "cache_transceiver_config": {"auth_token": TOKEN},
             "restart": {"max_quick_deaths": 3, "backoff_s": 0.2}}
PROMPT = "Topic: lighthouses. The answer should be short, clear and correct, and it should cite facts. " * 2


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    with launched_with_output("disagg.yaml", tmp_path_factory.mktemp("engine-process-deploy"), OVERRIDES) as found:
        yield found


def feeds_live(url: str) -> bool:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    lines = [line for line in text.splitlines() if line.startswith("pdserve_router_kv_feed_live{")]
    return len(lines) == 2 and all(line.endswith(" 1.0") for line in lines)


def test_both_servers_run_their_engine_in_a_child_process(deployment):
    dep, _ = deployment
    for name in ("context-0", "generation-0"):
        assert engine_child(pid_of(dep, name)).cmdline()[-2:] == ["-m", "server.engine_host.main"]


def test_the_pair_is_token_exact_through_the_router(deployment):
    dep, _ = deployment
    dh.check_answers_and_streams(dh.openai_client(dep.url), MODEL, PROMPT, 20, "Tell me about the sea.")
    assert dep.metric(dep.generation_urls[0], "pdserve_kv_transfer_seconds_count") > 0  # the KV was pulled
    for url in dep.context_urls + dep.generation_urls:
        wait_until(lambda u=url: in_use(dep, u) == 0, 10, what=f"no block in use on {url}")


def test_the_kv_routes_answer_through_the_engine_link(deployment):
    dep, _ = deployment
    ctx, gen = dep.context_urls[0], dep.generation_urls[0]
    endpoint = httpx.get(f"{ctx}/kv_cache/endpoint", headers=AUTHORISED, timeout=10).json()
    assert endpoint["endpoint"].startswith("tcp://127.0.0.1:") and endpoint["epoch"]
    assert httpx.get(f"{gen}/kv_cache/endpoint", headers=AUTHORISED, timeout=10).status_code == 404
    assert httpx.get(f"{gen}/health", timeout=10).json()["context_servers"] == {ctx: "compatible"}

    prompt = fresh_prompt("release")
    params = context_only(ctx, prompt)[0]["choices"][0]["disaggregated_params"]
    assert params["ctx_endpoint"] == endpoint["endpoint"] and params["ctx_epoch"] == endpoint["epoch"]
    wait_until(lambda: in_use(dep, ctx) > 0, 5, what="the lease's blocks pinned")
    released = httpx.post(f"{ctx}/kv_cache/release", json={"ctx_request_id": params["ctx_request_id"]},
                          headers=AUTHORISED, timeout=10)
    assert released.status_code == 200
    wait_until(lambda: in_use(dep, ctx) == 0, 5, what="the released lease's blocks back")

    snapshot = httpx.get(f"{ctx}/kv_cache/hashes", headers=AUTHORISED, timeout=10).json()
    assert snapshot["seq"] > 0 and snapshot["hashes"] and snapshot["tokens_per_block"] == 32
    events = httpx.get(f"{ctx}/kv_cache/events", headers=AUTHORISED, timeout=10).json()
    assert events["endpoint"].startswith("tcp://127.0.0.1:")
    assert events["epoch"] == snapshot["epoch"] == httpx.get(f"{ctx}/health", timeout=10).json()["epoch"]
    assert httpx.get(f"{ctx}/kv_cache/hashes", timeout=10).status_code == 401  # still behind the token


def test_kv_events_reach_the_routers_index(deployment):
    dep, _ = deployment
    wait_until(lambda: feeds_live(dep.url), 60, what="the router's KV feeds are live")
    before = dep.metric(dep.url, "pdserve_router_kv_events_total")
    prompt = fresh_prompt("events") * 2
    complete(dep.url, prompt)
    wait_until(lambda: dep.metric(dep.url, "pdserve_router_kv_events_total") > before, 10,
               what="the new blocks' events at the router")
    again = complete(dep.url, prompt + " And then?")
    assert (again["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) >= 64
    assert dep.metric(dep.url, "pdserve_router_kv_resyncs_total") == 0


def test_a_killed_engine_process_ends_its_server_and_the_launcher_restarts_it(deployment):
    dep, out = deployment
    reference = complete(dep.url, PROMPT)["choices"][0]["text"]
    gen_pid = pid_of(dep, "generation-0")
    os.kill(engine_child(gen_pid).pid, signal.SIGKILL)
    wait_until(lambda: "generation-0 exited with exit code 1" in out.read_text(), 30,
               what="the server exits non-zero", on_timeout=dep.logs)
    wait_until(lambda: back_again(dep, "generation-0", gen_pid, dep.generation_urls[0]), 90,
               what="the generation server back and unfenced", on_timeout=dep.logs)
    assert pid_of(dep, "generation-0") != gen_pid
    assert "the engine process exited with signal SIGKILL" in (dep.log_dir / "generation-0.log").read_text()
    assert complete(dep.url, PROMPT)["choices"][0]["text"] == reference
