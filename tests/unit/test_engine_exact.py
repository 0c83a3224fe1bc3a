"""The whole engine (scheduler + runner + KV manager) token for token against transformers generate,
on dense models and the mixture-of-experts ones (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2/V3, GLM-4.5)."""

from __future__ import annotations

import engine_harness as eh
import hf_reference
import pytest
from prompts import random_prompt

from kvcache import KvCacheConfig
from server.models.builtin import resolve_model

LLAMA = "builtin:tiny-llama"
SWA = "builtin:tiny-qwen3-swa"
MOE = ["builtin:tiny-mixtral", "builtin:tiny-qwen2-moe", "builtin:tiny-qwen3-moe"]
V2, V3 = "builtin:tiny-deepseek-v2", "builtin:tiny-deepseek-v3"  # latent attention: the cache is the latent
GLM = "builtin:tiny-glm4-moe"  # RoPE on half of each head; DeepSeek-V3's gate


def _expected(model: str, prompt: list[int], n: int) -> list[int]:
    return hf_reference.hf_greedy(resolve_model(model), prompt, n)


@pytest.mark.parametrize("model, length", [(LLAMA, 7), (LLAMA, 70), (SWA, 150), *((m, 40) for m in MOE), (V2, 70),
                                           (V3, 150), (GLM, 70)])
def test_single_request_matches_transformers(model, length):
    core = eh.make_core(model)
    prompt = random_prompt(length, length)
    [result] = eh.generate(core, [prompt], eh.greedy(20))
    assert result.token_ids == _expected(model, prompt, 20)
    assert result.final.finish_reason == "length"
    assert result.final.completion_tokens == 20
    core.kv.check_integrity()


@pytest.mark.parametrize("model", [LLAMA, SWA, *MOE, V3, GLM])
def test_concurrent_requests_with_chunked_prefill_match(model):
    core = eh.make_core(model, max_num_tokens=48, max_batch_size=8)  # prompts up to 160 tokens: chunked
    prompts = [random_prompt(100 + i, n) for i, n in enumerate([3, 17, 160, 45, 96, 1])]
    results = eh.generate(core, prompts, eh.greedy(12))
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == _expected(model, prompt, 12)
    assert eh.blocks_in_use(core.kv) == 0
    core.kv.check_integrity()


@pytest.mark.parametrize("model", [LLAMA, *MOE, V2])
def test_repeated_prompt_reuses_prefix_and_partial_block(model):
    core = eh.make_core(model)  # tokens_per_block 16
    base = random_prompt(7, 64)  # 4 full blocks
    first = eh.generate(core, [base], eh.greedy(8))[0]
    again = eh.generate(core, [base], eh.greedy(8))[0]
    assert again.token_ids == first.token_ids == _expected(model, base, 8)
    assert first.final.cached_tokens == 0
    assert again.final.cached_tokens == 63  # all but the last token (its logits are needed): 15 of block 4
    longer = base + random_prompt(9, 6)  # the partial fifth block of a prompt is not cached; full blocks are
    assert eh.generate(core, [longer], eh.greedy(8))[0].final.cached_tokens == 64
    shared = base[:40] + random_prompt(8, 30)  # 2 full blocks + 8 tokens of the third
    partial = eh.generate(core, [shared], eh.greedy(8))[0]
    assert partial.final.cached_tokens == 40
    assert partial.token_ids == _expected(model, shared, 8)


@pytest.mark.parametrize("model", [LLAMA, *MOE, V3])
def test_small_pool_offloads_onboards_and_preempts_without_changing_output(model):
    kv = KvCacheConfig(tokens_per_block=16, max_tokens=12 * 16, host_cache_size=64 * 16 * 2048,
                       secondary_offload_min_priority=0)
    core = eh.make_core(model, kv=kv, max_num_tokens=64, max_batch_size=4)
    prompts = [random_prompt(200 + i, 40 + 7 * i) for i in range(4)]  # 4 x ~6 blocks at the end > 12 blocks
    results = eh.generate(core, prompts, eh.greedy(48))
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == _expected(model, prompt, 48)
    assert core.scheduler.num_preemptions > 0
    replay = eh.generate(core, prompts[:2], eh.greedy(48))  # cached on the host tier by now
    for prompt, result in zip(prompts[:2], replay, strict=True):
        assert result.token_ids == _expected(model, prompt, 48)
        assert result.final.cached_tokens > 0
    stats = core.kv.stats()
    assert stats.offloads > 0 and stats.onboards > 0
    assert eh.blocks_in_use(core.kv) == 0
    core.kv.check_integrity()
