"""After the start-up warm-up, serving compiles nothing: an engine on CUDA (Triton kernels, decode
graphs, bf16) runs staggered requests of many prompt lengths, shared prefixes (paged prefill after
a cached prefix) and every decode batch size, and no Triton kernel gains a compiled variant. Bursts
of fresh prompts submitted at once while others decode (async scheduling: steps of many prompts,
eager or replayed with decode rows) compile nothing either, and the caching allocator reserves no
new large segment for them. The bucketed cuDNN prefill agrees with FlashAttention. Skipped without
CUDA."""

from __future__ import annotations

import random

import engine_harness as eh
import pytest
import torch
from transformers import AutoTokenizer

from kvcache import KvCacheConfig, KVCacheManager
from server.engine.core import EngineCore
from server.engine.scheduler import SchedulerConfig
from server.models import dense_prefill
from server.models.builtin import materialize_builtin
from server.models.model_spec import load_spec
from server.models.runner import ModelRunner
from server.types import GenerateRequest, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _core(model_dir, max_batch: int, max_tokens: int, async_scheduling: bool = False) -> EngineCore:
    spec = load_spec(model_dir)
    device = torch.device("cuda")
    kv = KVCacheManager(KvCacheConfig(tokens_per_block=32, max_tokens=65536),
                        spec.cache_layout(4096, torch.bfloat16, device), salt=spec.fingerprint)
    runner = ModelRunner(model_dir, kv, dtype=torch.bfloat16, device=device, max_num_tokens=max_tokens,
                         max_batch_size=max_batch, kernels="triton", cuda_graphs=True, max_seq_len=4096)
    runner.warm_up()
    limits = SchedulerConfig(max_tokens, max_batch, 4096)
    return EngineCore(runner, kv, limits, AutoTokenizer.from_pretrained(model_dir), async_scheduling=async_scheduling)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3-swa"])
def test_serving_after_warm_up_compiles_nothing(tmp_path, name: str) -> None:
    from server.models.kernels.variants import compiled_variants

    core = _core(materialize_builtin(name, root=tmp_path), max_batch=48, max_tokens=2048)
    warmed = compiled_variants()
    rng = random.Random(7)
    shared = [rng.randrange(10, 400) for _ in range(300)]
    pending = [shared[:rng.randint(40, 300)] + [rng.randrange(10, 400) for _ in range(rng.randint(1, 900))]
               if i % 3 == 0 else [rng.randrange(10, 400) for _ in range(rng.randint(1, 1500))] for i in range(120)]
    live, steps = 0, 0
    while pending or core.has_work():
        for _ in range(rng.randint(0, 6) if pending else 0):  # arrivals between steps: varied batches
            params = SamplingParams(max_tokens=rng.randint(1, 40), temperature=0.0, ignore_eos=True)
            core.add_request(GenerateRequest(f"r{live}", pending.pop(), params))
            live += 1
        core.step()
        steps += 1
        assert steps < 20000
    assert compiled_variants() == warmed


BURST = 32


def _large_segments() -> int:
    """cudaMalloc calls of the caching allocator's large pool (blocks over 1 MB) so far. (The small
    pool's 2 MB segments are left out: serving keeps a few small tensors alive across steps, the
    sampled ids in flight, that the warm-up never holds, at the cost of one small cudaMalloc.)"""
    return torch.cuda.memory_stats()["segment.large_pool.allocated"]


def _burst(core: EngineCore, rng: random.Random, tag: str) -> int:
    """BURST fresh prompts at once, then one step; returns how many of them that step started."""
    for i in range(BURST):
        prompt = [rng.randrange(10, 400) for _ in range(rng.randint(16, 160))]
        params = SamplingParams(max_tokens=rng.randint(8, 48), temperature=0.0, ignore_eos=True)
        core.add_request(GenerateRequest(f"{tag}{i}", prompt, params))
    core.step()
    return sum(1 for i in range(BURST) if (r := eh.live_request(core, f"{tag}{i}")) and r.num_computed_tokens)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3-swa"])
def test_bursts_after_warm_up_compile_and_allocate_nothing(tmp_path, name: str) -> None:
    from server.models.kernels.variants import compiled_variants

    core = _core(materialize_builtin(name, root=tmp_path), max_batch=48, max_tokens=2048, async_scheduling=True)
    warmed, segments = compiled_variants(), _large_segments()
    rng = random.Random(11)
    for i in range(8):  # streams decoding when the first burst comes
        params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        core.add_request(GenerateRequest(f"d{i}", [rng.randrange(10, 400) for _ in range(64)], params))
    for _ in range(4):
        core.step()
    started = [_burst(core, rng, "a")]
    for _ in range(6):  # the first burst decodes and the streams go on: the second comes into both
        core.step()
    started.append(_burst(core, rng, "b"))
    steps = 0
    while core.has_work():
        core.step()
        steps += 1
        assert steps < 5000
    assert started[0] >= 12 and started[1] >= 1  # many prompts in one step; then as rows free up
    assert core.runner.graphs.mixed_replays > 0  # short prompts rode in graph replays too
    assert compiled_variants() == warmed
    assert _large_segments() == segments


def test_bucketed_cudnn_prefill_agrees_with_flash(monkeypatch) -> None:
    torch.manual_seed(0)
    heads, kv_heads, d = 32, 8, 128
    for n in (1024, 1500, 3001):
        qkv = torch.randn(n, heads + 2 * kv_heads, d, dtype=torch.bfloat16, device="cuda")
        monkeypatch.setenv("PDSERVE_DENSE_PREFILL", "flash")
        flash = dense_prefill.causal_sdpa(qkv, heads, kv_heads, d**-0.5)
        monkeypatch.setenv("PDSERVE_DENSE_PREFILL", "auto")
        bucketed = dense_prefill.causal_sdpa(qkv, heads, kv_heads, d**-0.5)
        assert bucketed.shape == flash.shape == (n, heads, d)
        torch.testing.assert_close(bucketed.float(), flash.float(), atol=2e-2, rtol=2e-2)
