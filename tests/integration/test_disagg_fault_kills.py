"""Fault injection that kills servers of real deployments (`pdserve launch`, SIGKILL, loopback).

Each test launches its own deployment, since it breaks it: a generation server killed mid-stream
(`disagg.yaml`) and a context server killed in `disagg_2x2.yaml`. Helpers come from
test_disagg_faults.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import deploy_harness as dh
import httpx
from test_disagg_faults import (
    AUTHORISED,
    FAST_S,
    PROMPT,
    TOKEN,
    assert_transfer_failed,
    complete,
    context_only,
    fresh_prompt,
    generation_only,
    in_use,
    long_stream,
    wait_idle,
)
from waiting import wait_until


@contextmanager
def launched_with_output(config: str, tmp_path: Path,
                         overrides: dict | None = None) -> Iterator[tuple[dh.Deployment, Path]]:
    """`deploy_harness.launched`, but the launcher's own stdout (its exit reports) goes to a file."""
    path, cfg = dh.write_config(dh.ROOT / "configs" / config, tmp_path, overrides)
    out = tmp_path / "launcher.out"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    with open(out, "wb") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "server.cli", "launch", str(path), "--log-dir", str(tmp_path / "logs")],
            cwd=dh.ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    dep = dh.Deployment(
        url=f"http://127.0.0.1:{cfg['port']}",
        context_urls=[f"http://{u}" for u in cfg["context_servers"]["urls"]],
        generation_urls=[f"http://{u}" for u in cfg["generation_servers"]["urls"]],
        process=process, log_dir=tmp_path / "logs", config=cfg)
    try:
        dh._wait_ready(dep)  # the router answers; the launcher may still be probing it:
        wait_until(lambda: "[pdserve launch] ready:" in out.read_text(), 60, what="the launcher's ready line")
        yield dep, out
    finally:
        dh.stop(process)


# ---- 1. generation server killed mid-stream ---------------------------------------------------

NO_RESTART = {"restart": {"max_quick_deaths": 0}}  # the killed server stays dead (test_supervision.py restarts)


def test_generation_server_killed_mid_stream(tmp_path):
    with launched_with_output("disagg.yaml", tmp_path, NO_RESTART) as (dep, out):
        ctx, gen = dep.context_urls[0], dep.generation_urls[0]
        [gen_pid] = dep.server_pids("generation")
        with long_stream(dep.url) as events:
            os.kill(gen_pid, signal.SIGKILL)
            killed = time.monotonic()
            rest = list(events)
            ended_after = time.monotonic() - killed
        assert ended_after < FAST_S, f"the stream took {ended_after:.1f} s to end"
        assert "[DONE]" not in rest
        error = json.loads(rest[-1])["error"]
        assert error["message"].startswith("generation leg failed mid-stream"), error
        assert error["type"] == "server_error"

        # the context server released its lease on the Ack, long before the lease would expire
        wait_until(lambda: in_use(dep, ctx) == 0, 5, what="context blocks released")
        assert dep.metric(ctx, "pdserve_kv_transfer_lease_expired_total") == 0

        def router_health() -> httpx.Response:
            return httpx.get(f"{dep.url}/health", timeout=5)

        wait_until(lambda: router_health().status_code == 503, 5, what="router /health 503")
        servers = router_health().json()["servers"]
        assert (servers[gen]["healthy"], servers[ctx]["healthy"]) == (False, True)
        wait_until(lambda: "generation-0 exited with signal SIGKILL" in out.read_text(), 5,
                   what="the launcher reports the exit")
        assert dep.process.poll() is None  # the launcher keeps the rest running

        # a new request: the generation leg has nowhere to go; the context server keeps nothing
        response = httpx.post(f"{dep.url}/v1/completions", timeout=30,
                              json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0.0})
        assert response.status_code == 503
        assert response.json()["error"]["message"] == "generation leg failed: no healthy generation server"
        wait_until(lambda: in_use(dep, ctx) == 0, 5, what="no context lease left behind")


# ---- 2. context server killed (2 + 2) -----------------------------------------------------------

GEN_TIMEOUT_MS = 3000  # the 2 + 2 deployment's generation-side kv_transfer_timeout_ms
TOPICS = ("rivers", "bridges", "tides", "comets", "glaciers", "lanterns")


def router_knows_cache_of(dep: dh.Deployment, url: str) -> bool:
    """The router's index of `url`'s cache (kept from its KV events) holds as many blocks as the
    server's own snapshot, and some."""
    snapshot = httpx.get(f"{url}/kv_cache/hashes", headers=AUTHORISED, timeout=10).json()
    held = sum(len(hashes) for levels in snapshot["windows"].values() for hashes in levels.values())
    return held > 0 and dep.metric(dep.url, "pdserve_router_kv_index_blocks", f'server="{url}"') == held


def topic_prompt(topic: str) -> str:
    return f"Topic: {topic}. " + "Keep the answer short, clear and correct. " * 3


def test_context_server_killed_is_fenced_and_the_other_serves(tmp_path):
    pull_timeout = {**NO_RESTART, "cache_transceiver_config": {"auth_token": TOKEN},
                    "generation_servers": {"cache_transceiver_config": {"kv_transfer_timeout_ms": GEN_TIMEOUT_MS}}}
    with dh.launched("disagg_2x2.yaml", tmp_path, pull_timeout) as dep:
        dead, alive = dep.context_urls
        gen0, gen1 = dep.generation_urls
        dead_pid = dh.pid_of(dep, "context-0")
        for topic in TOPICS:  # warm `dead`'s prefix cache so kv_cache_aware keeps choosing it
            context_only(dead, topic_prompt(topic))
        # leases on `dead` for pulls after its death; gen0 pulls once first, so it holds a live link
        orphans = [(p, context_only(dead, p)[0]["choices"][0]["disaggregated_params"])
                   for p in (fresh_prompt("link"), fresh_prompt("lost"), fresh_prompt("refused"))]
        assert generation_only(gen0, *orphans[0])[0].status_code == 200
        wait_until(lambda: router_knows_cache_of(dep, dead), 30, what="the router's index of the doomed server")
        os.kill(dead_pid, signal.SIGKILL)
        for topic in TOPICS:  # the first ones race the health monitor: the retry must cover them
            complete(dep.url, topic_prompt(topic))
        servers = httpx.get(f"{dep.url}/health", timeout=5).json()["servers"]
        assert (servers[dead]["healthy"], servers[alive]["healthy"]) == (False, True)
        assert httpx.get(f"{dep.url}/health", timeout=5).status_code == 200

        # a pull from the dead server fails at once, whether the link to it was up (gen0) or not (gen1)
        for gen, (prompt, params) in zip((gen0, gen1), orphans[1:], strict=True):
            response, seconds = generation_only(gen, prompt, params)
            assert_transfer_failed(response, seconds, f"the context server at {params['ctx_endpoint']} "
                                                      "is unreachable")
        wait_idle(dep, [alive, *dep.generation_urls], 10)
        complete(dep.url, fresh_prompt("after"))
