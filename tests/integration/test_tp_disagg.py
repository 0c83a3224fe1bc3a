"""Context and generation servers of different tensor-parallel sizes, through the router, exact.

Context TP=2 -> generation TP=1 (the generation server merges the two context ranks' kv heads into
each block) and TP=1 -> TP=2 (each generation rank takes its half of the heads of one sender's
slots), on the sliding-window model (two window groups; out-of-window blocks are not pulled), in
the replay style of test_disagg_replay.py: the context pool holds 32 blocks and a host tier takes
what it evicts, so replayed prompts are onboarded on every context rank before their KV is sent.
Every text must equal transformers `generate`; replays hit the cache; no block stays in use. The
last case streams the KV while it is prefilled in 64-token steps (`kv_stream: on`): each generation
rank's part is served as the context server's prefill writes the blocks. A mixture-of-experts model
(tiny-qwen2-moe) goes from a context server whose two ranks hold four whole experts each and route
every token (`expert_parallel_size: 2`) to a generation server whose two ranks send each token to
its experts' rank by all-to-all (`expert_dispatch: all_to_all`), and both count their experts'
tokens on /metrics.
"""

from __future__ import annotations

import deploy_harness as dh
import hf_reference
import httpx
import pytest
from waiting import wait_until

from server.models.builtin import resolve_model

MODEL, MOE = "builtin:tiny-qwen3-swa", "builtin:tiny-qwen2-moe"
DEEPSEEK = "builtin:tiny-deepseek-v3"  # a latent KV cache: the same on every rank, moved once
PROMPTS = dh.topic_prompts(3)
PAYLOAD = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}


def _overrides(ctx_tp: int, gen_tp: int, kv_stream: str, model: str = MODEL) -> dict:
    ep = {"expert_parallel_size": ctx_tp} if model == MOE else {}
    a2a = {"expert_parallel_size": gen_tp, "expert_dispatch": "all_to_all"} if model == MOE and gen_tp > 1 else {}
    return {"model": model, "device": "cpu", "max_seq_len": 512,
            "context_servers": {"tensor_parallel_size": ctx_tp, "max_num_tokens": 64 if kv_stream == "on" else 512,
                                "kv_stream": kv_stream, "kv_cache_config": {"host_cache_size": 4 << 20}, **ep},
            "generation_servers": {"tensor_parallel_size": gen_tp, "max_num_tokens": 512,
                                   "kv_cache_config": {"max_tokens": 4096}, **a2a}}


def _reference_texts(model: str) -> list[str]:
    return [hf_reference.hf_text_ignore_eos(resolve_model(model), p, 12) for p in PROMPTS]


@pytest.mark.parametrize(("ctx_tp", "gen_tp", "kv_stream", "model"),
                         [(2, 1, "auto", MODEL), (1, 2, "auto", MODEL), (1, 2, "on", MODEL), (2, 2, "auto", MOE)])
def test_replay_between_tp_sizes_matches_transformers(tmp_path, ctx_tp, gen_tp, kv_stream, model):
    with dh.launched("disagg_host_offload.yaml", tmp_path, _overrides(ctx_tp, gen_tp, kv_stream, model)) as dep:
        ctx, gen = dep.context_urls[0], dep.generation_urls[0]
        dh.check_replays(dep.url, PROMPTS, PAYLOAD, _reference_texts(model), 2)
        if model == MOE:  # layer 0's experts: every prompt token on the context server, the decoded ones here
            for url in (ctx, gen):
                assert dep.metric(url, "pdserve_moe_expert_tokens_total", 'layer="0"') > 0
        assert dep.metric(ctx, "pdserve_kv_offloaded_blocks_total") > 0
        assert dep.metric(ctx, "pdserve_kv_onboarded_blocks_total") > 0
        assert dep.metric(gen, "pdserve_kv_transfer_seconds_count") > 0
        assert (dep.metric(gen, "pdserve_kv_transfer_streamed_total") > 0) == (kv_stream == "on")
        for url in (ctx, gen):
            wait_until(lambda u=url: dep.metric(u, "pdserve_kv_cache_blocks", 'state="in_use"') == 0, 10,
                       what=f"no block in use on {url}")
        endpoints = httpx.get(f"{ctx}/kv_cache/endpoint", headers={"x-pdserve-token": _token(dep)}).json()
        assert len(endpoints["endpoints"]) == ctx_tp and endpoints["endpoints"][0] == endpoints["endpoint"]


@pytest.mark.parametrize(("ctx_tp", "gen_tp", "kv_stream"), [(2, 1, "auto"), (1, 2, "on")])
def test_a_latent_cache_moves_once_between_tp_sizes(tmp_path, ctx_tp, gen_tp, kv_stream):
    """DeepSeek-V3: the context server's rank 0 alone serves the latent (/kv_cache/endpoint lists
    one endpoint), the generation server's rank 0 alone pulls it and shares it with its other rank;
    texts equal transformers, replays hit the cache, no block stays in use."""
    with dh.launched("disagg_host_offload.yaml", tmp_path, _overrides(ctx_tp, gen_tp, kv_stream, DEEPSEEK)) as dep:
        ctx, gen = dep.context_urls[0], dep.generation_urls[0]
        dh.check_replays(dep.url, PROMPTS, PAYLOAD, _reference_texts(DEEPSEEK), 2)
        assert dep.metric(gen, "pdserve_kv_transfer_seconds_count") > 0
        for url in (ctx, gen):
            wait_until(lambda u=url: dep.metric(u, "pdserve_kv_cache_blocks", 'state="in_use"') == 0, 10,
                       what=f"no block in use on {url}")
        endpoints = httpx.get(f"{ctx}/kv_cache/endpoint", headers={"x-pdserve-token": _token(dep)}).json()
        assert endpoints["endpoints"] == [endpoints["endpoint"]]


def _token(dep: dh.Deployment) -> str:
    return (dep.log_dir / "auth_token").read_text().strip()
