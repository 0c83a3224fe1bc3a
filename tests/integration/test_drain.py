"""Graceful drain on a real deployment, restarts off: a generation server SIGTERMed mid-stream finishes
the stream, refuses new work (503 "draining") and exits 0; an operator starts it again by hand with the
command the launcher printed (the token from the file it names); SIGTERM on the launcher drains the router
(a stream in flight ends complete, new requests get 503) and then the servers.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading

import deploy_harness as dh
import httpx
from deploy_harness import pid_of
from test_disagg_fault_kills import launched_with_output
from test_disagg_faults import SHARED, complete
from test_supervision import PROMPT
from waiting import wait_until

# a generous drain: on a loaded 2-core machine a 400-token stream can outlast the default 30 s, and
# what this test checks is the order of the drain, not its limit
NOT_RESTARTING = {**SHARED, "restart": {"max_quick_deaths": 0}, "drain_timeout_s": 150}
STREAM_S = 150  # the longest a 400-token stream may take here


def stream(url: str, results: dict) -> threading.Thread:
    body = {"prompt": PROMPT, "max_tokens": 400, "temperature": 0.0, "ignore_eos": True, "stream": True}

    def run() -> None:
        texts, lines = [], []
        with httpx.Client(timeout=60) as client, client.stream("POST", f"{url}/v1/completions", json=body) as r:
            results["status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                    results["events"] = len(lines)
                    if line != "data: [DONE]":
                        texts.append(json.loads(line[6:])["choices"][0].get("text") or "")
        results["done"] = lines[-1] == "data: [DONE]" if lines else False
        results["text"] = "".join(texts)

    thread = threading.Thread(target=run)
    thread.start()
    wait_until(lambda: results.get("events", 0) >= 3, 30, what="the stream under way")
    return thread


def test_drain_then_restart_by_hand_then_drain_the_whole_deployment(tmp_path):
    with launched_with_output("disagg.yaml", tmp_path, NOT_RESTARTING) as (dep, out):
        gen = dep.generation_urls[0]
        reference = complete(dep.url, PROMPT, max_tokens=400)["choices"][0]["text"]
        results: dict = {}
        thread = stream(dep.url, results)
        os.kill(pid_of(dep, "generation-0"), signal.SIGTERM)
        health = httpx.get(f"{gen}/health", timeout=5)
        assert health.status_code == 503 and health.json()["status"] == "draining", health.text
        refused = httpx.post(f"{dep.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 4}, timeout=30)
        assert refused.status_code == 503, refused.text  # the only generation server takes nothing new
        thread.join(STREAM_S)
        assert results["done"] and results["text"] == reference  # the stream in flight ended complete
        wait_until(lambda: "generation-0 exited with exit code 0" in out.read_text(), 20, what="a clean exit")
        assert "generation-0 is not restarted" in out.read_text()

        # the operator starts it again with the command the launcher printed
        command = re.search(r"start one server again by hand: (\S+)=(\S+) OMP_NUM_THREADS=(\d+) "
                            r"\S+(?: -m server\.cli)? serve --config (\S+) --server context-0  "
                            r"\(names: context-0, generation-0\)",
                            out.read_text())
        env_name, token_file, threads, deployment = command.groups()
        env = {**os.environ, env_name: token_file, "OMP_NUM_THREADS": threads}
        env.pop("PDSERVE_AUTH_TOKEN", None)
        argv = [sys.executable, "-m", "server.cli", "serve", "--config", deployment, "--server", "generation-0"]
        with open(tmp_path / "by-hand.log", "wb") as log:
            by_hand = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=dh.ROOT)
        try:
            wait_until(lambda: dh.router_ready(dep.url), 90, what=f"the server started by hand: {shlex.join(argv)}")
            assert complete(dep.url, PROMPT, max_tokens=400)["choices"][0]["text"] == reference

            # SIGTERM on the launcher: the router drains first, the stream in flight ends complete
            results = {}
            thread = stream(dep.url, results)
            dep.process.send_signal(signal.SIGTERM)
            wait_until(lambda: httpx.get(f"{dep.url}/health", timeout=5).status_code == 503, 5,
                       what="the router draining")
            refused = httpx.post(f"{dep.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=5)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
            thread.join(STREAM_S)
            assert results["done"] and results["text"] == reference
            assert dep.process.wait(timeout=60) == 0
        finally:
            by_hand.send_signal(signal.SIGTERM)
            by_hand.wait(timeout=60)
