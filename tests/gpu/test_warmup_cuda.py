"""After the start-up warm-up, serving compiles nothing: an engine on CUDA (Triton kernels, decode
graphs, bf16) runs staggered requests of many prompt lengths, shared prefixes (paged prefill after
a cached prefix) and every decode batch size, and no Triton kernel gains a compiled variant. The
bucketed cuDNN prefill agrees with FlashAttention. Skipped without CUDA."""

from __future__ import annotations

import random

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


def _core(model_dir, max_batch: int, max_tokens: int) -> EngineCore:
    spec = load_spec(model_dir)
    device = torch.device("cuda")
    kv = KVCacheManager(KvCacheConfig(tokens_per_block=32, max_tokens=65536),
                        spec.cache_layout(4096, torch.bfloat16, device), salt=spec.fingerprint)
    runner = ModelRunner(model_dir, kv, dtype=torch.bfloat16, device=device, max_num_tokens=max_tokens,
                         max_batch_size=max_batch, kernels="triton", cuda_graphs=True, max_seq_len=4096)
    runner.warm_up()
    limits = SchedulerConfig(max_tokens, max_batch, 4096)
    return EngineCore(runner, kv, limits, AutoTokenizer.from_pretrained(model_dir))


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
