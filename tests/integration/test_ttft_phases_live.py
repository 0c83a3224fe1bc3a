"""The phases of the time to first token on a real deployment (`pdserve launch configs/disagg.yaml`,
tiny-llama; docs/DISAGG_LOAD.md): after N requests of every kind the router serves through its two
legs (streamed completions and chat, JSON, and a prompt long enough for streamed KV), the router's
/metrics counts each of its phases N more times (the handoff once per streamed request: a JSON
generation leg answers after its decode), the context server its queue time and prefill, the
generation server its queue time and its KV pull, and nothing prefills on the generation server.
The router's own spans hold the servers' (one monotonic clock on one host): its context leg covers
the context server's queue time and prefill, its first event comes after the context answer."""

from __future__ import annotations

import deploy_harness as dh
import openai
from prompts import random_prompt
from waiting import wait_until

LLAMA = "builtin:tiny-llama"
ROUTER_PHASES = ("queue", "context", "handoff", "generation", "first_event")
STREAM_MIN_TOKENS = 257  # the context server prefills 256 tokens a step and streams longer prompts' KV


def _requests(client: openai.OpenAI) -> tuple[int, int]:
    """Every kind of request that has both legs: (the number sent, those streamed)."""
    prompts = [random_prompt(500 + i, 24) for i in range(4)]
    for prompt in prompts[:2]:
        chunks = list(client.completions.create(model=LLAMA, prompt=prompt, max_tokens=6, temperature=0,
                                                extra_body={"ignore_eos": True}, stream=True))
        assert chunks and chunks[-1].choices[0].finish_reason == "length"
    for prompt in prompts[2:]:
        answer = client.completions.create(model=LLAMA, prompt=prompt, max_tokens=6, temperature=0,
                                           extra_body={"ignore_eos": True})
        assert (answer.usage.completion_tokens, answer.choices[0].finish_reason) == (6, "length")
    chat = list(client.chat.completions.create(model=LLAMA, messages=[{"role": "user", "content": "phases"}],
                                               max_tokens=6, temperature=0, stream=True,
                                               extra_body={"ignore_eos": True}))
    assert chat[-1].choices[0].finish_reason == "length"
    long = list(client.completions.create(model=LLAMA, prompt=random_prompt(600, STREAM_MIN_TOKENS + 40),
                                          max_tokens=6, temperature=0, stream=True,
                                          stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert (long[-1].usage.completion_tokens, long[-1].usage.prompt_tokens) == (6, STREAM_MIN_TOKENS + 40)
    return len(prompts) + 2, 4


def _figures(dep: dh.Deployment) -> dict[str, float]:
    ctx, gen = dep.context_urls[0], dep.generation_urls[0]
    out = {f"router_{p}_{part}": dep.metric(dep.url, f"pdserve_router_phase_seconds_{part}", f'phase="{p}"')
           for p in ROUTER_PHASES for part in ("count", "sum")}
    for role, url in (("context", ctx), ("generation", gen)):
        for name, histogram in (("queue", "pdserve_request_queue_time_seconds"), ("prefill", "pdserve_prefill_seconds"),
                                ("transfer", "pdserve_kv_transfer_seconds")):
            for part in ("count", "sum"):
                out[f"{role}_{name}_{part}"] = dep.metric(url, f"{histogram}_{part}")
    return out


def test_every_phase_counts_each_request_once_on_the_router_and_the_servers(tmp_path):
    overrides = {"context_servers": {"max_num_tokens": 256}}  # kv_stream auto: longer prompts stream
    with dh.launched("disagg.yaml", tmp_path, overrides) as dep:
        before = _figures(dep)
        assert all(before[f"router_{p}_count"] == 0 for p in ROUTER_PHASES)  # shown before any request
        client = openai.OpenAI(base_url=f"{dep.url}/v1", api_key="unused", max_retries=0, timeout=120)
        sent, streamed = _requests(client)
        # a generation server counts a request's queue time when it ends, just after its last event
        after = wait_until(lambda: _figures(dep), 30, "every request's phases",
                           check=lambda f: f["generation_queue_count"] - before["generation_queue_count"] >= sent)
    grew = {key: after[key] - before[key] for key in after}
    counts = {key: grew[key] for key in grew if key.endswith("_count")}
    assert counts == {**{f"router_{p}_count": sent for p in ROUTER_PHASES}, "router_handoff_count": streamed,
                      "router_generation_count": streamed,
                      "context_queue_count": sent, "context_prefill_count": sent, "context_transfer_count": sent,
                      "generation_queue_count": sent, "generation_transfer_count": sent,
                      "generation_prefill_count": 0}, dep.logs()
    assert grew["router_context_sum"] >= grew["context_queue_sum"] + grew["context_prefill_sum"] > 0
    assert grew["router_first_event_sum"] >= grew["router_queue_sum"] + grew["router_context_sum"]
    assert grew["router_handoff_sum"] > 0 and grew["generation_transfer_sum"] > 0
    assert grew["router_generation_sum"] > 0
