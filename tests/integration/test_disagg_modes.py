"""Disaggregated deployments beyond the replay: sliding windows, streaming and chat through the
router with the real `openai` client, and a 2 + 2 deployment under each routing policy."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import deploy_harness as dh
import hf_reference
import openai
import pytest
import yaml
from waiting import wait_until

from pdserve_bench.launch import wait_for_health
from server.models.builtin import resolve_model

FILLER = "The system should keep the answer short, clear and correct, and it should cite the facts it uses. "
TOKEN = "disagg-modes-test-token-0123456789"  # the 2 + 2 deployment's, so that a router of the test's joins it


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def _hf_text(model: str, prompt: str, n: int) -> str:
    return hf_reference.hf_text_ignore_eos(resolve_model(model), prompt, n)


def _complete(client: openai.OpenAI, model: str, prompt: str, n: int = 16, **extra):
    return client.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0,
                                     extra_body={"ignore_eos": True}, **extra)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_sliding_window_pair_matches_transformers_beyond_the_window(tmp_path, async_scheduling):
    """Both ways of stepping the engine (async scheduling is off on a CPU unless set)."""
    model = "builtin:tiny-qwen3-swa"  # window 64 tokens; prompts of ~180 tokens
    prompts = [f"Topic: {t}. " + FILLER * 3 + " Now answer briefly:" for t in ("rivers", "bridges")]
    with dh.launched("disagg_vswa.yaml", tmp_path, {"async_scheduling": async_scheduling}) as dep:
        logs = "".join(p.read_text(errors="replace") for p in dep.log_dir.glob("*.log"))
        assert logs.count(f"async scheduling {async_scheduling}") == 2, dep.logs()  # both servers
        client = _client(dep.url)
        for prompt in prompts:
            first = _complete(client, model, prompt, 24)
            again = _complete(client, model, prompt, 24)
            assert first.choices[0].text == again.choices[0].text == _hf_text(model, prompt, 24)
            assert first.usage.prompt_tokens > 150
            assert again.usage.prompt_tokens_details.cached_tokens > 0
        for url in dep.context_urls + dep.generation_urls:
            wait_until(lambda u=url: dep.metric(u, "pdserve_kv_cache_blocks", 'state="in_use"') == 0, 10)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """configs/disagg.yaml, launched once: the streaming test uses it, then the SIGTERM test stops it."""
    with dh.launched("disagg.yaml", tmp_path_factory.mktemp("pair")) as dep:
        yield dep


def test_streaming_and_chat_through_the_router(pair):
    model = "builtin:tiny-llama"
    prompt = "Topic: tides. " + FILLER * 2
    dep = pair
    client = _client(dep.url)
    whole = _complete(client, model, prompt, 20)
    assert whole.choices[0].text == _hf_text(model, prompt, 20)
    stream = _complete(client, model, prompt, 20, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == 20
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True})
    streamed = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0,
                                              extra_body={"ignore_eos": True}, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert chat.usage.completion_tokens == 12
    assert text == chat.choices[0].message.content
    one = _complete(client, model, prompt, 1)  # the context leg alone finishes it
    assert one.choices[0].text == whole.choices[0].text[: len(one.choices[0].text)]
    assert one.usage.completion_tokens == 1
    assert len({c.id for c in chunks}) == 1  # the router's first chunk and the rest: one response
    streamed = list(client.chat.completions.create(model=model, messages=messages, max_tokens=12,
                                                   temperature=0, extra_body={"ignore_eos": True},
                                                   stream=True))
    assert len({c.id for c in streamed}) == 1
    assert [c.choices[0].delta.role for c in streamed if c.choices].count("assistant") == 1
    _held_back_first_text_joins_without_gap_or_repeat(client, model, prompt, one.choices[0].text, whole)


def _held_back_first_text_joins_without_gap_or_repeat(client, model, prompt, first, whole):
    """A stop string that starts with the first token's last character: the context server holds that
    character back, the router streams only what is safe, and the generation server goes on from there."""
    assert len(first) >= 2, first
    stop = first[-1] + "@@@"  # never completed, so the text is unchanged
    chunks = list(_complete(client, model, prompt, 20, stream=True, stop=[stop]))
    texts = [c.choices[0].text for c in chunks if c.choices and c.choices[0].text]
    assert texts[0] == first[:-1]
    assert "".join(texts) == whole.choices[0].text


def test_sigterm_stops_every_process_and_frees_every_port(pair):
    """The pair the streaming test used, stopped as the harness stops a deployment (SIGTERM to the
    launcher): every process it started ends and every port is free again."""
    import socket

    import psutil

    dep = pair
    pids = [p.pid for p in psutil.Process(dep.process.pid).children(recursive=True)]
    assert len(dep.server_pids("context")) == 1 and len(dep.server_pids("generation")) == 1
    ports = [int(u.rsplit(":", 1)[1]) for u in [dep.url, *dep.context_urls, *dep.generation_urls]]
    dh.stop(dep.process)
    assert dep.process.returncode == 0  # the launcher stopped cleanly on SIGTERM
    wait_until(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids),
               10, what="no child process left")
    for port in ports:
        with socket.socket() as s:  # as a restarted server would bind (TIME_WAIT of old clients allowed)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))  # raises if anything still listens there
            s.listen()


@pytest.fixture(scope="module")
def two_by_two(tmp_path_factory) -> Iterator[dh.Deployment]:
    """configs/disagg_2x2.yaml, launched once with a known token: each policy's test runs a router of
    its own (`pdserve router`) in front of the same four servers."""
    with dh.launched("disagg_2x2.yaml", tmp_path_factory.mktemp("2x2"), {"cache_transceiver_config": {
            "auth_token": TOKEN}}) as dep:
        yield dep


@contextmanager
def router(dep: dh.Deployment, tmp: Path, policy: str) -> Iterator[str]:
    """`pdserve router` for `dep`'s servers under `policy`, on a port of its own; yields its URL."""
    cfg = {**dep.config, "port": dh.free_port(), "router": {**dep.config["router"], "type": policy}}
    path = tmp / f"router-{policy}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    url = f"http://127.0.0.1:{cfg['port']}"
    with open(tmp / f"router-{policy}.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "server.cli", "router", "--config", str(path)], cwd=dh.ROOT,
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        if not wait_for_health(url, dh.STARTUP_TIMEOUT_S, lambda: proc.poll() is None, interval_s=0.3):
            raise AssertionError(f"router not healthy:\n{(tmp / f'router-{policy}.log').read_text()[-3000:]}")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.mark.parametrize("policy", ["load_balancing", "round_robin"])  # kv_cache_aware:
# tests/integration/test_routing_live.py
def test_two_by_two_deployment(two_by_two, tmp_path, policy):
    """The servers are shared by both policies' tests: the texts are exact whatever their caches hold,
    and the work each context server took is counted from this test's start."""
    model = "builtin:tiny-llama"
    prompts = [f"Topic: {t}. " + FILLER * 3 for t in ("maps", "clocks", "lamps")]
    expected = [_hf_text(model, p, 12) for p in prompts]
    dep = two_by_two
    before = [dep.metric(u, "pdserve_generation_tokens_total") for u in dep.context_urls]
    with router(dep, tmp_path, policy) as url:
        client = _client(url)
        assert [_complete(client, model, p, 12).choices[0].text for p in prompts] == expected
        replays = [_complete(client, model, p, 12) for p in prompts for _ in range(2)]
        assert [r.choices[0].text for r in replays] == [e for e in expected for _ in range(2)]
    after = [dep.metric(u, "pdserve_generation_tokens_total") for u in dep.context_urls]
    served = [a - b for a, b in zip(after, before, strict=True)]
    assert all(s > 0 for s in served), served  # both context servers took work
