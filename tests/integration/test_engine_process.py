"""One real aggregated server whose engine runs in its own process (`engine_process: true`, on the
CPU): the answers equal transformers' token for token, streamed or not, completion or chat; a client
that leaves frees its request's blocks; /metrics shows the engine's histograms and KV figures; /health
and the drain work; and a SIGKILLed engine process fails the requests in flight with a 5xx error and
ends the server with a non-zero exit code (the launcher restarts it: test_engine_process_deploy.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from contextlib import AbstractContextManager
from pathlib import Path

import deploy_harness as dh
import hf_reference
import httpx
import psutil
import pytest
from deploy_harness import metric
from transformers import AutoTokenizer
from waiting import wait_until

from server.models.builtin import resolve_model

MODEL = "builtin:tiny-llama"
GREEDY = dh.GREEDY
CHILD = "server.engine_host.main"


def engine_server(tmp: Path, **settings) -> AbstractContextManager[tuple[str, subprocess.Popen]]:
    """`pdserve serve --config` with `engine_process: true`; yields (url, the server process)."""
    return dh.served(tmp, model=MODEL, engine_process=True, **settings)


def engine_child(proc: subprocess.Popen) -> psutil.Process:
    return dh.engine_child(proc.pid)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with engine_server(tmp_path_factory.mktemp("engine-process")) as (url, proc):
        yield url, proc


@pytest.fixture(scope="module")
def client(server):
    return dh.openai_client(server[0], timeout_s=60)


def _hf(prompt_ids: list[int], n: int) -> list[int]:
    return hf_reference.hf_greedy_ignore_eos(resolve_model(MODEL), prompt_ids, n)


def test_the_engine_runs_in_a_child_process_that_has_no_secret_on_its_command_line(server):
    url, proc = server
    child = engine_child(proc)
    assert child.cmdline()[-2:] == ["-m", CHILD]
    assert child.status() != psutil.STATUS_ZOMBIE


def test_completions_and_chat_equal_transformers_streamed_or_not(client):
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(MODEL))
    prompt = "The quick brown fox jumps over the lazy dog. " * 5
    expected = tokenizer.decode(_hf(tokenizer.encode(prompt), 20), skip_special_tokens=True)
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, **GREEDY)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, **GREEDY)
    assert first.choices[0].text == again.choices[0].text == expected
    assert first.usage.completion_tokens == 20 and first.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == 20

    messages = [{"role": "user", "content": "Name a colour."}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expected_chat = tokenizer.decode(_hf(tokenizer.encode(text, add_special_tokens=False), 10),
                                     skip_special_tokens=True)  # the server renders chat so (api/builder.py)
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, **GREEDY)
    streamed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, stream=True, **GREEDY)
    assert chat.choices[0].message.content == expected_chat
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == expected_chat


def test_health_models_and_the_readiness_probe(server):
    url, _ = server
    health = httpx.get(f"{url}/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok" and health.json()["epoch"]
    assert httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"] == MODEL
    probe = httpx.get(f"{url}/health_generate", timeout=60)
    assert probe.status_code == 200 and probe.json()["status"] == "ok", probe.text


def test_client_disconnect_aborts_and_frees_blocks(server):
    url, _ = server
    in_use = lambda: metric(url, "pdserve_kv_cache_blocks", 'state="in_use"')
    idle = lambda: in_use() == 0 and metric(url, "pdserve_requests") == 0
    wait_until(idle, 10, what="the server idle before the test")
    before = metric(url, "pdserve_generation_tokens_total")
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 490, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as response:
        for i, _ in enumerate(response.iter_lines()):
            if i >= 6:
                break  # leave mid-stream
    wait_until(idle, 10, what="blocks freed after the client left")
    assert metric(url, "pdserve_generation_tokens_total") - before < 300  # aborted, not run to its 490 tokens


def test_metrics_show_the_engines_histograms_and_kv_figures(server, client):
    url, _ = server
    prompt = "Metrics cross the process boundary, and a prompt sent twice hits its own blocks. " * 4
    for _ in range(2):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, **GREEDY)
    for name in ("pdserve_time_to_first_token_seconds_count", "pdserve_time_per_output_token_seconds_count",
                 "pdserve_e2e_request_latency_seconds_count", "pdserve_request_queue_time_seconds_count",
                 "pdserve_generation_tokens_total", "pdserve_prompt_tokens_total",
                 "pdserve_prefix_cache_query_tokens_total", "pdserve_prefix_cache_hit_tokens_total"):
        assert metric(url, name) > 0, name
    assert metric(url, "pdserve_kv_cache_blocks", 'state="free"') > 0
    assert metric(url, "pdserve_kv_cache_blocks", 'state="cached"') > 0  # the repeated prompt's blocks


def _stream_events(url: str, max_tokens: int, out: list) -> None:
    """A streamed completion's `data:` payloads into `out` (a status line first)."""
    body = {"model": MODEL, "prompt": "Keep going until told to stop.", "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True, "temperature": 0, "stream_options": {"include_usage": True}}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
            out.append(response.status_code)
            out.extend(line[6:] for line in response.iter_lines() if line.startswith("data: "))
    except httpx.HTTPError as exc:
        out.append(type(exc).__name__)


def test_sigterm_drains_the_stream_then_stops_the_engine_process(tmp_path):
    with engine_server(tmp_path, drain_timeout_s=120) as (url, proc):
        child = engine_child(proc)
        events: list = []
        reader = threading.Thread(target=_stream_events, args=(url, 200, events))
        reader.start()
        wait_until(lambda: len(events) > 3, 60, what="the stream under way")
        proc.send_signal(signal.SIGTERM)
        health = httpx.get(f"{url}/health", timeout=5)
        assert health.status_code == 503 and health.json()["status"] == "draining"
        reader.join(120)
        assert events[0] == 200 and events[-1] == "[DONE]"
        assert json.loads(events[-2])["usage"]["completion_tokens"] == 200  # the whole stream, drained
        assert proc.wait(timeout=60) == 0
        wait_until(lambda: not child.is_running() or child.status() == psutil.STATUS_ZOMBIE, 10,
                   what="the engine process stopped")


def test_a_killed_engine_process_fails_requests_in_flight_and_ends_the_server(tmp_path):
    with engine_server(tmp_path) as (url, proc):
        events: list = []
        reader = threading.Thread(target=_stream_events, args=(url, 450, events))
        reader.start()
        wait_until(lambda: len(events) > 3, 60, what="the stream under way")
        os.kill(engine_child(proc).pid, signal.SIGKILL)
        reader.join(60)
        assert events[0] == 200 and events[-1] == "[DONE]", events[-3:]
        error = json.loads(events[-2])["error"]
        assert "the engine process exited with signal SIGKILL" in error["message"], error
        assert error["code"] == "engine_error"
        assert proc.wait(timeout=60) != 0  # the launcher's supervisor restarts a server that exits so
        log = (tmp_path / "server.log").read_text()
        assert "the engine process exited with signal SIGKILL: failing 1 requests in flight" in log


def test_an_engine_process_that_cannot_load_ends_the_server_with_its_error(tmp_path):
    missing = tmp_path / "no-model-here"
    done = subprocess.run([sys.executable, "-m", "server.cli", "serve", str(missing), "--port", str(dh.free_port()),
                           "--engine-process", "true"], cwd=dh.ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert f"exiting: the engine could not start: ValueError: model '{missing}': no such directory" in done.stderr
