"""The replay test of TensorRT-LLM's Python-transceiver host-offload PR, on real processes.

Six ~200-token prompts go through `configs/disagg_host_offload.yaml` (a 32-block context pool and
a host tier), once one by one, then five times all six at once. Replays must hit the prefix cache,
read back exactly the KV they wrote (identical text) although blocks were offloaded and onboarded
in between, and match aggregated mode and transformers `generate` token for token (tiny-llama, and
tiny-deepseek-v3 with the KV streamed: latent attention and mixture-of-experts layers; the other MoE
families take the same paths in tests/unit's exactness tests). The same again
with all three tiers in use: an 8-block host pool and a disk tier behind it on the context server,
so blocks go down to files and come back up through the host pool.
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


LLAMA, DEEPSEEK_V3 = "builtin:tiny-llama", "builtin:tiny-deepseek-v3"
BLOCK_BYTES = 32 * 2048  # tiny-llama: 32 tokens x 2 KiB per token (4 layers, K and V, 2 heads x 32)
FIRST_PASS_BLOCKS = 44  # the blocks the first pass (the six prompts one by one, cold caches) sends for tiny-llama


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """A model's reference texts: pass 1 through aggregated mode, equal to transformers generate on
    the same prompts (computed once per model)."""
    texts: dict[str, list[str]] = {}

    def of(model: str) -> list[str]:
        if model not in texts:
            texts[model] = _aggregated_and_transformers(model, tmp_path_factory.mktemp("agg"))
        return texts[model]

    return of


def _aggregated_and_transformers(model: str, tmp_path) -> list[str]:
    model_dir = resolve_model(model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hf = [tokenizer.decode(hf_reference.hf_greedy_ignore_eos(model_dir, tokenizer.encode(p), 16),
                           skip_special_tokens=True) for p in PROMPTS]
    with dh.launched("aggregated.yaml", tmp_path, {"model": model}) as agg:
        aggregated = [b["choices"][0]["text"] for b in asyncio.run(_serial(agg.url))]
    assert aggregated == hf
    return hf


@pytest.fixture(scope="module")
def reference_texts(references) -> list[str]:
    return references(LLAMA)


def _replay(dep: dh.Deployment, reference_texts: list[str]) -> None:
    _first_pass(dep, reference_texts)
    _replays(dep, reference_texts)


def _first_pass(dep: dh.Deployment, reference_texts: list[str]) -> None:
    first = asyncio.run(_serial(dep.url))
    assert [b["choices"][0]["text"] for b in first] == reference_texts


def _replays(dep: dh.Deployment, reference_texts: list[str]) -> None:
    for _ in range(5):
        replay = asyncio.run(_concurrent(dep.url))
        assert [b["choices"][0]["text"] for b in replay] == reference_texts
        assert all(b["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 for b in replay)


@pytest.mark.parametrize("model", [LLAMA, DEEPSEEK_V3])
def test_replay_through_host_offload_pair_with_streamed_kv(tmp_path, references, model):
    """The same, the KV sent while it is prefilled in 64-token steps (`kv_stream: on`): blocks of a
    step already sent may be offloaded later, blocks not yet sent are pinned where the step wrote them.
    The context server runs its engine in a process of its own (the default on CUDA). Also on a
    mixture-of-experts model (its dense layer 1 and its sparse layers), and on DeepSeek-V3 (its
    latent KV cache through both tiers and the pair)."""
    with dh.launched("disagg_host_offload.yaml", tmp_path, {"model": model, "context_servers": {
            "kv_stream": "on", "max_num_tokens": 64, "engine_process": True}}) as dep:
        _replay(dep, references(model))
        ctx, gen = dep.context_urls[0], dep.generation_urls[0]
        assert dep.metric(ctx, "pdserve_kv_offloaded_blocks_total") > 0
        assert dep.metric(ctx, "pdserve_kv_onboarded_blocks_total") > 0
        assert dep.metric(ctx, "pdserve_kv_transfer_streamed_total") > 0
        assert dep.metric(gen, "pdserve_kv_transfer_streamed_total") > 0
        for url in (ctx, gen):
            wait_until(lambda u=url: _in_use(dep, u) == 0, 10, what=f"no block in use on {url}")


def test_replay_through_host_offload_pair(tmp_path, reference_texts):
    """The float32 KV moves as it is: the first pass sends FIRST_PASS_BLOCKS whole blocks of 2 KiB a
    token (an FP8 pair sends a quarter of it: tests/integration/test_fp8_kv_deploy.py)."""
    with dh.launched("disagg_host_offload.yaml", tmp_path) as dep:
        _first_pass(dep, reference_texts)
        sent = dep.metric(dep.generation_urls[0], "pdserve_kv_transfer_bytes_total")
        assert sent == FIRST_PASS_BLOCKS * BLOCK_BYTES
        _replays(dep, reference_texts)
        ctx = dep.context_urls[0]
        assert dep.metric(ctx, "pdserve_kv_offloaded_blocks_total") > 0
        assert dep.metric(ctx, "pdserve_kv_onboarded_blocks_total") > 0
        for url in dep.context_urls + dep.generation_urls:
            wait_until(lambda u=url: _in_use(dep, u) == 0, 10, what=f"no block in use on {url}")




def test_replay_through_host_and_disk_tiers(tmp_path, reference_texts):
    disk = {"path": str(tmp_path / "kv-disk"), "max_bytes": 64 * BLOCK_BYTES}
    tiers = {"host_cache_size": 8 * BLOCK_BYTES, "disk": disk}
    with dh.launched("disagg_host_offload.yaml", tmp_path, {"context_servers": {"kv_cache_config": tiers}}) as dep:
        _replay(dep, reference_texts)
        ctx = dep.context_urls[0]
        for name in ("offloaded", "onboarded", "disk_offloaded", "disk_onboarded"):
            assert dep.metric(ctx, f"pdserve_kv_{name}_blocks_total") > 0, name
        assert dep.metric(ctx, "pdserve_kv_disk_dropped_blocks_total") == 0
        assert dep.metric(ctx, "pdserve_kv_cache_blocks", 'level="disk",state="cached"') > 0
        for url in dep.context_urls + dep.generation_urls:
            wait_until(lambda u=url: _in_use(dep, u) == 0, 10, what=f"no block in use on {url}")
    assert list((tmp_path / "kv-disk" / "w2048").glob("*.kv"))
