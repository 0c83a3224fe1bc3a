"""Request migration on a real deployment: 1 context + 2 generation servers.

The generation server serving a stream is SIGKILLed mid-stream; the router moves the request to the
other one (re-prefill of prompt + generated tokens through the context server) and the client's
stream goes on: one id, no error, [DONE], and with greedy sampling the text (and usage) of an
undisturbed run. Completions and chat, one move each; the move is counted in /metrics.
"""

from __future__ import annotations

import json
import os
import signal

import deploy_harness as dh
import httpx
from waiting import wait_until

TWO_GENERATION = {
    "restart": {"max_quick_deaths": 3, "backoff_s": 0.2},  # the killed server comes back for the next case
    "router": {"type": "round_robin", "migration_limit": 1},
    "generation_servers": {"num_instances": 2, "urls": ["x:1", "x:2"]},  # ports rewritten by the harness
}
PROMPT = "Migration keeps a stream going when its server dies: "
MAX_TOKENS = 300
KILL_AFTER_EVENTS = 15


def running_on(dep: dh.Deployment) -> str:
    """The generation server URL with a request running. (Its gauge is the engine's last relayed state,
    which can trail the stream's events on a busy machine: read until one shows it, for at most 10 s.)"""
    def serving() -> str | None:
        return next((url for url in dep.generation_urls
                     if dep.metric(url, "pdserve_requests", 'state="running"') > 0), None)

    return wait_until(serving, 10, "a generation server running the request")


def pid_serving(dep: dh.Deployment, url: str) -> int:
    """pid of the launcher's child for generation server `url` (generation-<its index>)."""
    return dh.pid_of(dep, f"generation-{dep.generation_urls.index(url)}")


def stream_and_kill(dep: dh.Deployment, path: str, body: dict, text_of) -> tuple[str, set[str], dict | None]:
    """Stream `body`, SIGKILL the serving generation server after a few events; (text, ids, usage)."""
    texts, ids, usage = [], set(), None
    with httpx.Client(timeout=60) as client, \
            client.stream("POST", dep.url + path, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        events = 0
        for line in response.iter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line  # the token comments never reach the client
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                break
            event = json.loads(data)
            assert "error" not in event, event
            ids.add(event["id"])
            if event["choices"]:
                texts.append(text_of(event["choices"][0]) or "")
            usage = event.get("usage") or usage
            events += 1
            if events == KILL_AFTER_EVENTS:
                os.kill(pid_serving(dep, running_on(dep)), signal.SIGKILL)
        else:
            raise AssertionError("the stream ended without [DONE]")
    return "".join(texts), ids, usage


def check_moved_stream(dep: dh.Deployment, chat: bool, moves_before: float) -> None:
    if chat:
        path, text_of = "/v1/chat/completions", lambda c: c.get("delta", {}).get("content")
        body = {"messages": [{"role": "user", "content": PROMPT}]}
    else:
        path, text_of = "/v1/completions", lambda c: c.get("text")
        body = {"prompt": PROMPT}
    body.update(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, stream_options={"include_usage": True})
    whole = httpx.post(dep.url + path, json={k: v for k, v in body.items() if k != "stream_options"},
                       timeout=120).json()
    reference = whole["choices"][0]["message"]["content"] if chat else whole["choices"][0]["text"]
    text, ids, usage = stream_and_kill(dep, path, body, text_of)
    assert text == reference
    assert len(ids) == 1  # one stream, one id, before and after the move
    assert usage["completion_tokens"] == MAX_TOKENS
    assert usage["prompt_tokens"] == whole["usage"]["prompt_tokens"]
    assert dep.metric(dep.url, "pdserve_router_migrations_total") == moves_before + 1
    ctx = dep.context_urls[0]
    wait_until(lambda: dep.metric(ctx, "pdserve_kv_cache_blocks", 'state="in_use"') == 0, 10,
               what="no context block left pinned")


def all_healthy(dep: dh.Deployment) -> bool:
    response = httpx.get(dep.url + "/health", timeout=5)
    return response.status_code == 200 and all(s["healthy"] for s in response.json()["servers"].values())


def test_stream_moves_to_the_other_generation_server_and_text_equals_undisturbed(tmp_path):
    with dh.launched("disagg.yaml", tmp_path, TWO_GENERATION) as dep:
        check_moved_stream(dep, chat=False, moves_before=0)
        servers = httpx.get(dep.url + "/health", timeout=5).json()["servers"]
        assert sorted(servers[u]["healthy"] for u in dep.generation_urls) == [False, True]  # fenced at once
        wait_until(lambda: all_healthy(dep), 60, what="the killed server restarted and unfenced")
        check_moved_stream(dep, chat=True, moves_before=1)
