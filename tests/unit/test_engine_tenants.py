"""Tenants in the engine (tiny-llama, real KV manager, outputs token for token against transformers):
cache salts separate prefix reuse, retention priorities order eviction and the host offload, the
vLLM-like metrics count, and a disaggregated pair in one process (a real KV sender and receiver on
loopback) pulls only blocks it lacks under the request's salt."""

from __future__ import annotations

import engine_harness as eh
import hf_reference
import pytest
from prompts import random_prompt
from waiting import wait_until

from kvcache import KvCacheConfig
from server.models.builtin import resolve_model
from server.telemetry.metrics import ServerMetrics
from server.types import DisaggParams

LLAMA = "builtin:tiny-llama"


def _expected(prompt: list[int], n: int) -> list[int]:
    return hf_reference.hf_greedy(resolve_model(LLAMA), prompt, n)


def _run(core, prompt: list[int], n: int = 4, **kw) -> eh.Result:
    rid = eh.submit(core, prompt, eh.greedy(n), **kw)
    return eh.run_to_completion(core, [rid])[rid]


def test_salts_separate_prefix_reuse_and_leave_outputs_exact():
    core = eh.make_core(LLAMA)  # tokens_per_block 16
    prompt = random_prompt(1, 50)
    want = _expected(prompt, 6)
    runs = [("a", 0), ("a", 48), ("b", 0), (None, 0), (None, 48), ("b", 48)]  # 3 full blocks cached
    for salt, cached in runs:
        result = _run(core, prompt, 6, cache_salt=salt)
        assert (result.token_ids, result.final.cached_tokens) == (want, cached), salt
    assert eh.blocks_in_use(core.kv) == 0
    core.kv.check_integrity()


def _pressure_core(**kv) -> object:
    config = KvCacheConfig(tokens_per_block=16, max_tokens=8 * 16, **kv)
    return eh.make_core(LLAMA, kv=config, max_num_tokens=256)


HIGH, LOW = random_prompt(10, 48), random_prompt(11, 48)  # 3 blocks each


def _fill_high_then_low(core) -> None:
    """HIGH (priority 80) ends first, LOW (priority 20) after it: plain LRU would evict HIGH first."""
    for prompt, priority in ((HIGH, 80), (LOW, 20)):
        result = _run(core, prompt, 1, kv_retention_priority=priority)
        assert result.token_ids == _expected(prompt, 1)


def test_low_priority_blocks_are_evicted_first():
    core = _pressure_core()
    _fill_high_then_low(core)  # 6 of 8 blocks cached
    press = random_prompt(12, 80)  # 5 blocks: 2 free ones, then 3 evictions
    assert _run(core, press, 1).token_ids == _expected(press, 1)
    assert core.kv.stats().evictions == 3
    high, low = _run(core, HIGH, 4), _run(core, LOW, 4)
    assert (high.final.cached_tokens, low.final.cached_tokens) == (47, 0)  # LOW's blocks went
    assert high.token_ids == _expected(HIGH, 4) and low.token_ids == _expected(LOW, 4)


def test_only_blocks_at_or_above_the_offload_priority_reach_the_host_tier():
    core = _pressure_core(host_cache_size=16 * 16 * 1024 * 1024 // 1024, secondary_offload_min_priority=50)
    assert core.kv.num_slots(512, level=1) >= 3
    _fill_high_then_low(core)
    press = random_prompt(13, 128)  # 8 blocks: every cached block is evicted
    assert _run(core, press, 1).token_ids == _expected(press, 1)
    stats = core.kv.stats()
    assert (stats.evictions, stats.offloads) == (6, 3)  # LOW's 3 dropped, HIGH's 3 offloaded
    high, low = _run(core, HIGH, 4), _run(core, LOW, 4)
    assert (high.final.cached_tokens, low.final.cached_tokens) == (47, 0)
    stats = core.kv.stats()  # two blocks onboarded, 15 tokens of the third copied from the host
    assert (stats.onboards, stats.bytes_onboarded) == (2, 3 * core.kv.slot_bytes(512))
    assert high.token_ids == _expected(HIGH, 4) and low.token_ids == _expected(LOW, 4)


def test_engine_metrics_count_prompts_preemptions_and_latencies():
    metrics = ServerMetrics()
    config = KvCacheConfig(tokens_per_block=16, max_tokens=6 * 16)
    core = eh.make_core(LLAMA, kv=config, max_num_tokens=64, max_batch_size=4)
    core.timings.metrics = metrics
    prompts = [random_prompt(20 + i, 30) for i in range(3)]  # 3 x (30 + 40) tokens > 6 blocks: preemption
    results = eh.generate(core, prompts, eh.greedy(40))
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == _expected(prompt, 40)
    from server.telemetry.relay import RelayedMetrics, engine_figures

    RelayedMetrics(metrics).update(engine_figures(core))
    text = metrics.render().decode()
    value = lambda name: float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))
    assert core.scheduler.num_preemptions > 0
    assert value("pdserve_num_preemptions_total") == core.scheduler.num_preemptions
    assert value("pdserve_prompt_tokens_total") == 90
    assert value("pdserve_e2e_request_latency_seconds_count") == 3
    assert value("pdserve_request_queue_time_seconds_count") == 3
    assert value("pdserve_e2e_request_latency_seconds_sum") > value("pdserve_request_queue_time_seconds_sum")


# ---- a disaggregated pair in one process --------------------------------------------------------


@pytest.fixture
def pair():
    with eh.loopback_pair(LLAMA) as run:
        yield run.cores


def _through_pair(ctx, gen, prompt: list[int], n: int, salt: str | None) -> tuple[list[int], int, DisaggParams]:
    """(tokens, bytes the generation server pulled, the context answer's params)."""
    first = _run(ctx, prompt, n, disagg=DisaggParams("context_only"), cache_salt=salt)
    params = first.final.disagg
    assert params is not None and params.cache_salt == salt  # the salt travels to the generation leg
    gen_params = eh.generation_params(first.final, cache_salt=params.cache_salt)
    before = gen.connector.receiver.stats.bytes_received
    eh.submit(gen, prompt, eh.greedy(n), disagg=gen_params, cache_salt=params.cache_salt)
    result = eh.Result()

    def finished() -> bool:
        ctx.step()  # take back the lease when the pull ends
        for output in gen.step():
            result.token_ids += output.new_token_ids
            result.final = output if output.finished else None
        return result.final is not None

    wait_until(finished, 60, "the generation leg to finish", interval_s=0.001)
    assert result.final.finish_reason == "length", result.final.error
    return result.token_ids, gen.connector.receiver.stats.bytes_received - before, params


def test_the_pair_pulls_only_what_it_lacks_under_the_request_salt(pair):
    ctx, gen = pair
    block = gen.kv.slot_bytes(512)
    prompt = random_prompt(30, 40)  # blocks 0, 1 full; block 2 holds 8 prompt tokens
    want = _expected(prompt, 12)
    tokens, pulled, _ = _through_pair(ctx, gen, prompt, 12, "tenant-a")
    assert (tokens, pulled) == (want, 3 * block)
    # the generation server now caches blocks 0, 1 and block 2 (8 prompt + 8 generated tokens): the
    # same prompt is complete locally, its partly matching last block included, so nothing is pulled
    tokens, pulled, _ = _through_pair(ctx, gen, prompt, 12, "tenant-a")
    assert (tokens, pulled) == (want, 0)
    copies = gen.kv.stats().bytes_copied_primary
    other = prompt[:36] + random_prompt(31, 8)  # block 2 matches 4 tokens only: it is pulled whole, not copied
    tokens, pulled, _ = _through_pair(ctx, gen, other, 12, "tenant-a")
    assert (tokens, pulled) == (_expected(other, 12), block)
    assert gen.kv.stats().bytes_copied_primary == copies
    tokens, pulled, _ = _through_pair(ctx, gen, prompt, 12, "tenant-b")  # another salt reuses nothing
    assert (tokens, pulled) == (want, 3 * block)
    for core in (ctx, gen):
        eh.run_to_completion(core, [])
        core.kv.check_integrity()
