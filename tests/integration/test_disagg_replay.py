"""The replay test of TensorRT-LLM's Python-transceiver host-offload PR, on real processes.

Six ~200-token prompts go through `configs/disagg_host_offload.yaml` (a 32-block context pool and
a host tier), once one by one, then five times all six at once. Replays must hit the prefix cache,
read back exactly the KV they wrote (identical text) although blocks were offloaded and onboarded
in between, and match aggregated mode and transformers `generate` token for token.
"""

from __future__ import annotations

import asyncio

import deploy_harness as dh
import hf_reference
import httpx
import pytest
from transformers import AutoTokenizer
from waiting import wait_until

from server.models.builtin import resolve_model

TOPICS = ["astronomy", "cooking", "gardening", "history", "music", "sailing"]
FILLER = "The system should keep the answer short, clear and correct, and it should cite the facts it uses. "
PROMPTS = [f"Topic: {t}. " + FILLER * 4 + " Now answer briefly:" for t in TOPICS]
PAYLOAD = {"max_tokens": 16, "temperature": 0.0, "ignore_eos": True}


async def _complete(client: httpx.AsyncClient, url: str, prompt: str) -> dict:
    response = await client.post(f"{url}/v1/completions", json={"prompt": prompt, **PAYLOAD}, timeout=180)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["usage"]["completion_tokens"] == 16
    assert body["choices"][0]["text"]
    return body


async def _serial(url: str) -> list[dict]:
    async with httpx.AsyncClient() as client:
        return [await _complete(client, url, p) for p in PROMPTS]


async def _concurrent(url: str) -> list[dict]:
    async with httpx.AsyncClient() as client:
        return await asyncio.gather(*(_complete(client, url, p) for p in PROMPTS))


def _in_use(deployment: dh.Deployment, url: str) -> float:
    return deployment.metric(url, "pdserve_kv_cache_blocks", 'state="in_use"')


@pytest.fixture(scope="module")
def reference_texts(tmp_path_factory) -> list[str]:
    """Pass 1 through aggregated mode, and transformers generate on the same prompts."""
    model_dir = resolve_model("builtin:tiny-llama")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hf = [tokenizer.decode(hf_reference.hf_greedy_ignore_eos(model_dir, tokenizer.encode(p), 16),
                           skip_special_tokens=True) for p in PROMPTS]
    with dh.launched("aggregated.yaml", tmp_path_factory.mktemp("agg")) as agg:
        aggregated = [b["choices"][0]["text"] for b in asyncio.run(_serial(agg.url))]
    assert aggregated == hf
    return hf


def test_replay_through_host_offload_pair(tmp_path, reference_texts):
    with dh.launched("disagg_host_offload.yaml", tmp_path) as dep:
        first = asyncio.run(_serial(dep.url))
        assert [b["choices"][0]["text"] for b in first] == reference_texts
        for _ in range(5):
            replay = asyncio.run(_concurrent(dep.url))
            assert [b["choices"][0]["text"] for b in replay] == reference_texts
            assert all(b["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 for b in replay)
        ctx = dep.context_urls[0]
        assert dep.metric(ctx, "pdserve_kv_offloaded_blocks_total") > 0
        assert dep.metric(ctx, "pdserve_kv_onboarded_blocks_total") > 0
        for url in dep.context_urls + dep.generation_urls:
            wait_until(lambda u=url: _in_use(dep, u) == 0, 10, what=f"no block in use on {url}")
