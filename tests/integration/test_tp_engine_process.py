"""Tensor-parallel servers whose engine runs in a process of its own (`engine_process: true`), with
async scheduling forced on: the engine process is rank 0 and starts the other ranks itself.

A context server and a generation server of two ranks each behind the router (`pdserve launch`),
driven by the real `openai` client. In order, on the one deployment of the module:
1. each server's rank 1 is a child of its engine process, not of the HTTP process;
2. completions and chat, streamed and not, equal transformers (the KV crossed per rank pair);
3. /kv_cache/endpoint lists both context ranks' KV senders, read through the engine link;
4. a context rank SIGKILLed ends its engine process with code 3, and the server with it (code 3);
   `pdserve launch` restarts the whole server and answers are exact again.
"""

from __future__ import annotations

import os
import signal

import deploy_harness as dh
import httpx
import openai
import psutil
import pytest
from deploy_harness import back_again, children_running, engine_child, pid_of
from test_disagg_fault_kills import launched_with_output
from test_disagg_faults import AUTHORISED, TOKEN
from test_disagg_modes import _hf_text
from waiting import wait_until

MODEL = "builtin:tiny-llama"
OVERRIDES = {
    "model": MODEL, "device": "cpu", "max_seq_len": 512, "max_num_tokens": 512, "max_batch_size": 8,
    "engine_process": True, "async_scheduling": True, "tensor_parallel_size": 2,
    "cache_transceiver_config": {"auth_token": TOKEN},
    "restart": {"max_quick_deaths": 3, "backoff_s": 0.2},
    "kv_cache_config": {"tokens_per_block": 16},
}
GREEDY = dh.GREEDY
PROMPT = "Topic: harbours. Each rank holds half of the heads, and the answer must not change. " * 3


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    with launched_with_output("disagg.yaml", tmp_path_factory.mktemp("tp-engine-process"), OVERRIDES) as found:
        yield found


@pytest.fixture(scope="module")
def client(deployment):
    return dh.openai_client(deployment[0].url)


def rank1(engine: psutil.Process) -> psutil.Process:
    [rank] = children_running(engine.pid, "spawn_main")
    return rank


def test_the_engine_process_starts_the_other_ranks(deployment):
    dep, _ = deployment
    for name in ("context-0", "generation-0"):
        server = pid_of(dep, name)
        assert not children_running(server, "spawn_main")
        assert rank1(engine_child(server)).is_running()
    logs = "".join(p.read_text(errors="replace") for p in dep.log_dir.glob("*.log"))
    assert logs.count("async scheduling True") == 2


def test_completions_and_chat_are_exact(client, deployment):
    dep, _ = deployment
    dh.check_answers_and_streams(client, MODEL, PROMPT, 16, "What does each rank hold?")
    assert dep.metric(dep.generation_urls[0], "pdserve_kv_transfer_seconds_count") > 0  # the KV was pulled


def test_the_kv_endpoint_lists_every_context_rank(deployment):
    dep, _ = deployment
    advertised = httpx.get(f"{dep.context_urls[0]}/kv_cache/endpoint", headers=AUTHORISED, timeout=10).json()
    assert len(advertised["endpoints"]) == 2 and advertised["endpoints"][0] == advertised["endpoint"]
    assert len(set(advertised["endpoints"])) == 2 and advertised["epoch"]


def test_a_killed_rank_ends_the_engine_process_and_its_server(client, deployment):
    dep, out = deployment
    reference = _hf_text(MODEL, PROMPT, 10)
    server = pid_of(dep, "context-0")
    os.kill(rank1(engine_child(server)).pid, signal.SIGKILL)
    wait_until(lambda: "context-0 exited with exit code 3" in out.read_text(), 30, what="the server's exit",
               on_timeout=dep.logs)
    assert "the engine process exited with exit code 3" in (dep.log_dir / "context-0.log").read_text()
    wait_until(lambda: back_again(dep, "context-0", server, dep.context_urls[0]), 120,
               what="the context server restarted and unfenced",
               on_timeout=dep.logs)
    assert pid_of(dep, "context-0") != server
    answers: list[str] = []
    wait_until(lambda: _answered(client, answers), 10, what="the generation server knows the new KV endpoint")
    assert answers[0] == reference


def _answered(client: openai.OpenAI, answers: list[str]) -> bool:
    """One completion, unless the generation server refuses the restarted context server's new KV
    endpoint for now (403: it refreshes its directory at most every 0.5 s, server/api/context_directory.py)."""
    try:
        answers.append(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, **GREEDY).choices[0].text)
    except openai.PermissionDeniedError:
        return False
    return True
