"""Supervision and graceful drain on real deployments.

1. `pdserve launch` restarts a SIGKILLed generation server, then a SIGKILLed context server, on
   their ports: the router fences each at once and unfences it when healthy, the peer that stayed
   up keeps running (the context server survives a generation server that restarts on its address:
   smg #2503) and shakes hands with the new process (new epoch; a context server comes back on a
   new KV endpoint that the generation server learns), and answers equal an undisturbed run. A
   context server SIGTERMed while it holds a lease drains: /health 503 "draining", the lease is
   still pulled, then it exits 0 and is restarted.
(The graceful drain with restarts off: test_drain.py.)
"""

from __future__ import annotations

import os
import signal
import threading
import time

import deploy_harness as dh
import httpx
from deploy_harness import back_again, pid_of
from test_disagg_fault_kills import launched_with_output
from test_disagg_faults import AUTHORISED, SHARED, complete, context_only, fresh_prompt, generation_only, in_use
from waiting import wait_until

RESTARTING = {**SHARED, "restart": {"max_quick_deaths": 3, "backoff_s": 0.2}}
PROMPT = "Supervision brings a dead server back: " + "every request ends, every block comes back. " * 2


def kv_endpoint(url: str) -> dict:
    return httpx.get(f"{url}/kv_cache/endpoint", headers=AUTHORISED, timeout=5).json()


def load(dep: dh.Deployment, n: int, results: list) -> threading.Thread:
    """`n` concurrent requests with long prompts (so transfers are under way), outcomes into `results`."""
    def one(i: int) -> None:
        body = {"prompt": fresh_prompt(f"load{i}") * 3, "max_tokens": 64, "temperature": 0.0, "ignore_eos": True}
        try:
            results.append(httpx.post(f"{dep.url}/v1/completions", json=body, timeout=60).status_code)
        except httpx.HTTPError as exc:
            results.append(type(exc).__name__)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    joiner = threading.Thread(target=lambda: [t.join() for t in threads])
    joiner.start()
    return joiner


def test_dead_servers_come_back_and_peers_shake_hands_again(tmp_path):
    with launched_with_output("disagg.yaml", tmp_path, RESTARTING) as (dep, out):
        ctx, gen = dep.context_urls[0], dep.generation_urls[0]
        reference = complete(dep.url, PROMPT)["choices"][0]["text"]
        ctx_pid, gen_pid = pid_of(dep, "context-0"), pid_of(dep, "generation-0")

        results: list = []
        joiner = load(dep, 6, results)
        wait_until(lambda: dep.metric(gen, "pdserve_requests") > 0, 30, what="requests on the generation server")
        os.kill(gen_pid, signal.SIGKILL)  # transfers and decodes under way
        killed = time.monotonic()
        joiner.join(90)
        assert len(results) == 6 and all(r in (200, 502, 503) for r in results), results  # honest answers
        wait_until(lambda: "generation-0 exited with signal SIGKILL" in out.read_text(), 10,
                   what="the launcher sees the death")
        wait_until(lambda: back_again(dep, "generation-0", gen_pid, gen), 60,
                   what="the generation server back and unfenced")
        recovered_s = time.monotonic() - killed
        assert "restarting generation-0 in 0.2 s" in out.read_text()
        assert pid_of(dep, "generation-0") != gen_pid
        assert pid_of(dep, "context-0") == ctx_pid  # the context server lived through it
        assert complete(dep.url, PROMPT)["choices"][0]["text"] == reference
        wait_until(lambda: in_use(dep, ctx) == 0, 5, what="no lease left on the context server")

        before = kv_endpoint(ctx)
        os.kill(ctx_pid, signal.SIGKILL)
        wait_until(lambda: not dh.router_ready(dep.url), 5, what="the router fences the dead context server")
        wait_until(lambda: back_again(dep, "context-0", ctx_pid, ctx), 60, what="the context server back and unfenced")
        after = kv_endpoint(ctx)
        assert after["epoch"] != before["epoch"] and after["endpoint"] != before["endpoint"]
        gen_pid = pid_of(dep, "generation-0")
        assert complete(dep.url, PROMPT)["choices"][0]["text"] == reference  # pulled from the new endpoint
        peers = httpx.get(f"{gen}/health", timeout=5).json()["context_servers"]
        assert peers == {ctx: "compatible"}

        # SIGTERM with a lease held: the context server drains, the lease is still pulled, it exits 0
        prompt = fresh_prompt("drain")
        params = context_only(ctx, prompt)[0]["choices"][0]["disaggregated_params"]
        ctx_pid = pid_of(dep, "context-0")
        os.kill(ctx_pid, signal.SIGTERM)
        health = httpx.get(f"{ctx}/health", timeout=5)
        assert health.status_code == 503 and health.json()["status"] == "draining", health.text
        refused = httpx.post(f"{ctx}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=5)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
        pulled, _ = generation_only(gen, prompt, params)
        assert pulled.status_code == 200, pulled.text
        wait_until(lambda: "context-0 exited with exit code 0" in out.read_text(), 20, what="a clean exit")
        wait_until(lambda: back_again(dep, "context-0", ctx_pid, ctx), 60, what="the drained context server restarted")
        assert pid_of(dep, "generation-0") == gen_pid  # the generation server lived through both
        assert complete(dep.url, PROMPT)["choices"][0]["text"] == reference
        print(f"generation server SIGKILL -> router healthy again in {recovered_s:.1f} s")
