"""Async scheduling through the whole engine on the CPU, forced on: step k is launched
before step k-1's tokens are postprocessed, pending tokens are read on the device. Outputs token for
token against transformers and equal to sync mode (stops, lengths, sampling seeds), under preemption
with a host tier, with aborts mid-pipeline; the pipeline's state is checked after every step."""

from __future__ import annotations

import engine_harness as eh
import hf_reference
import pytest
from prompts import random_prompt

from kvcache import KvCacheConfig
from server.engine.request import Request, Status
from server.models.builtin import resolve_model
from server.types import SamplingParams

LLAMA = "builtin:tiny-llama"
SWA = "builtin:tiny-qwen3-swa"


def _expected(model: str, prompt: list[int], n: int) -> list[int]:
    return hf_reference.hf_greedy(resolve_model(model), prompt, n)


def _generate(core, prompts: list[list[int]], params: list[SamplingParams]) -> list[eh.Result]:
    ids = [eh.submit(core, p, s) for p, s in zip(prompts, params, strict=True)]
    results, _ = eh.run_checked(core, ids)
    return [results[i] for i in ids]


def _summary(result: eh.Result) -> tuple:
    """What a client sees but the prefix cache hit (the runs compared share prompts differently)."""
    final = result.final
    return result.token_ids, result.text, final.finish_reason, final.completion_tokens, final.prompt_tokens


@pytest.mark.parametrize("model", [LLAMA, SWA])
def test_concurrent_requests_with_chunked_prefill_match_transformers(model):
    core = eh.make_core(model, max_num_tokens=48, max_batch_size=8, async_scheduling=True)
    lengths = [3, 17, 160, 45, 96, 1, 70, 30, 12]  # more than a batch: some wait for a slot
    prompts = [random_prompt(100 + i, n) for i, n in enumerate(lengths)]
    news = [12, 5, 9, 1, 20, 2, 7, 16, 3]
    results = _generate(core, prompts, [eh.greedy(n) for n in news])
    for prompt, n, result in zip(prompts, news, results, strict=True):
        assert result.token_ids == _expected(model, prompt, n)
        assert (result.final.finish_reason, result.final.completion_tokens) == ("length", n)
    assert eh.blocks_in_use(core.kv) == 0
    core.kv.check_integrity()


def test_tokens_reach_the_host_one_step_late():
    """The prefill's token is pending (on the device) when its step returns; the next step, whose
    row takes that token on the device, brings it to the host."""
    core = eh.make_core(LLAMA, async_scheduling=True)
    prompt = random_prompt(1, 20)
    rid = eh.submit(core, prompt, eh.greedy(3))
    request = eh.live_request(core, rid)
    assert core.step() == []
    assert request.num_pending == 1 and core.inflight.requests == [request]
    assert (request.num_known_tokens, request.num_computed_tokens) == (20, 20)
    [output] = core.step()
    assert output.new_token_ids == _expected(LLAMA, prompt, 1)
    assert request.num_pending == 1 and core.inflight.requests == [request]  # the second token
    assert request.num_computed_tokens == request.num_known_tokens == 21
    results = eh.run_to_completion(core, [])
    assert output.new_token_ids + results[rid].token_ids == _expected(LLAMA, prompt, 3)


@pytest.mark.parametrize("switch_at", [2, 4, 5])
def test_switching_async_off_with_a_step_in_flight_loses_no_token(switch_at):
    """Async scheduling turned off between steps (as scripts/bench_gpu.py does to compare the two)
    with a step in flight: that step's token is read before the next schedule, and every token of
    the request, its last included, reaches its outputs."""
    core = eh.make_core(LLAMA, async_scheduling=True)
    prompt = random_prompt(2, 12)
    rid = eh.submit(core, prompt, eh.greedy(6))
    tokens = []
    for _ in range(switch_at):
        tokens += [t for o in core.step() for t in o.new_token_ids]
    assert core.inflight is not None
    core.async_scheduling = False
    results = eh.run_to_completion(core, [rid])
    assert tokens + results[rid].token_ids == _expected(LLAMA, prompt, 6)
    assert results[rid].final.finish_reason == "length"


def test_stop_rules_and_lengths_equal_sync_mode():
    """One batch mixing every ending, async, against each request alone in sync mode: stop token,
    stop string, EOS (stops, ignored, forbidden by min_tokens), max_tokens 1 and 2, max_seq_len."""
    sync = eh.make_core(LLAMA, max_seq_len=64)
    prompt = random_prompt(3, 10)
    greedy = eh.generate(sync, [prompt], eh.greedy(16))[0]
    stop = greedy.text[6:9]
    # their greedy continuations meet EOS after 38, 3, 11, 4, 24, 0 and 6 tokens
    eos_prompts = [[(37 * s + 11 * j) % 480 + 10 for j in range(8)] for s in (16, 20, 40, 57, 58, 165, 188)]
    cases = [
        (prompt, eh.greedy(16)),
        (prompt, SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=(greedy.token_ids[5],))),
        (prompt, SamplingParams(max_tokens=24, temperature=0.0, stop=(stop,), ignore_eos=True)),
        (prompt, SamplingParams(max_tokens=1, temperature=0.0)),
        (prompt, SamplingParams(max_tokens=2, temperature=0.0, min_tokens=2)),
        (prompt, SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)),  # max_seq_len ends it
    ]
    cases += [(p, SamplingParams(max_tokens=40, temperature=0.0, **extra))
              for p in eos_prompts for extra in ({}, {"ignore_eos": True}, {"min_tokens": 30})]
    expected = [_summary(eh.generate(sync, [p], s)[0]) for p, s in cases]
    assert [e[2] for e in expected[6::3]] == ["stop"] * 7
    core = eh.make_core(LLAMA, max_seq_len=64, async_scheduling=True)
    results = _generate(core, [p for p, _ in cases], [s for _, s in cases])
    assert [_summary(r) for r in results] == expected
    assert expected[0][0] == _expected(LLAMA, prompt, 16)
    assert eh.blocks_in_use(core.kv) == 0


def test_a_known_last_token_gets_no_row():
    """max_tokens ends are known in advance: a request computes prompt + max_tokens - 1 tokens,
    exactly as in sync mode, never a row whose token would be thrown away."""
    for async_on in (False, True):
        core = eh.make_core(LLAMA, async_scheduling=async_on)
        ids = [eh.submit(core, random_prompt(5 + n, 10), SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
               for n in (1, 2, 5)]
        requests = [eh.live_request(core, rid) for rid in ids]
        eh.run_to_completion(core, ids)
        assert [r.num_computed_tokens for r in requests] == [10, 11, 14]


def test_seeded_sampling_equals_sync_mode():
    prompts = [random_prompt(40 + i, 9 + 5 * i) for i in range(4)]
    params = [SamplingParams(max_tokens=20, temperature=1.1, top_p=0.9, top_k=40, seed=7),
              SamplingParams(max_tokens=20, temperature=0.8, seed=8, min_tokens=20),
              SamplingParams(max_tokens=20, temperature=1.3, top_k=5, seed=9, stop_token_ids=(42, 43)),
              eh.greedy(20)]
    sync = eh.make_core(LLAMA)
    expected = [_summary(eh.generate(sync, [p], s)[0]) for p, s in zip(prompts, params, strict=True)]
    results = _generate(eh.make_core(LLAMA, async_scheduling=True), prompts, params)
    assert [_summary(r) for r in results] == expected


def test_small_pool_preempts_and_offloads_without_changing_output():
    kv = KvCacheConfig(tokens_per_block=16, max_tokens=12 * 16, host_cache_size=64 * 16 * 2048,
                       secondary_offload_min_priority=0)
    core = eh.make_core(LLAMA, kv=kv, max_num_tokens=64, max_batch_size=4, async_scheduling=True)
    prompts = [random_prompt(200 + i, 40 + 7 * i) for i in range(4)]  # 4 x ~6 blocks at the end > 12 blocks
    results, preempted_pending = eh.run_checked(core, [eh.submit(core, p, eh.greedy(48)) for p in prompts])
    for prompt, result in zip(prompts, results.values(), strict=True):
        assert result.token_ids == _expected(LLAMA, prompt, 48)
    assert core.scheduler.num_preemptions > 0
    assert preempted_pending > 0  # a request was preempted with its token on the device
    replay = _generate(core, prompts[:2], [eh.greedy(48)] * 2)  # cached on the host tier by now
    for prompt, result in zip(prompts[:2], replay, strict=True):
        assert result.token_ids == _expected(LLAMA, prompt, 48)
        assert result.final.cached_tokens > 0
    stats = core.kv.stats()
    assert stats.offloads > 0 and stats.onboards > 0
    assert eh.blocks_in_use(core.kv) == 0
    core.kv.check_integrity()


def test_prefix_cache_hits_are_reported_as_in_sync_mode():
    core = eh.make_core(LLAMA, async_scheduling=True)  # tokens_per_block 16
    base = random_prompt(7, 64)
    first = _generate(core, [base], [eh.greedy(8)])[0]
    again = _generate(core, [base], [eh.greedy(8)])[0]
    assert again.token_ids == first.token_ids == _expected(LLAMA, base, 8)
    assert (first.final.cached_tokens, again.final.cached_tokens) == (0, 63)
    assert _generate(core, [base + random_prompt(9, 6)], [eh.greedy(8)])[0].final.cached_tokens == 64
    shared = base[:40] + random_prompt(8, 30)
    partial = _generate(core, [shared], [eh.greedy(8)])[0]
    assert partial.final.cached_tokens == 40 and partial.token_ids == _expected(LLAMA, shared, 8)
    # a concurrent request sees what the first one computed one step later than in sync mode
    together = _generate(core, [base[:48] + random_prompt(11, 20)] * 2, [eh.greedy(8)] * 2)
    assert [r.final.cached_tokens for r in together] == [48, 48]


def test_abort_of_a_request_in_the_step_in_flight():
    """The aborted request's row of the step in flight is discarded, nothing follows its abort
    output, the others are exact, and every block comes back."""
    core = eh.make_core(LLAMA, async_scheduling=True)
    prompts = [random_prompt(60 + i, 12 + 9 * i) for i in range(4)]
    ids = [eh.submit(core, p, eh.greedy(24)) for p in prompts]
    victim = eh.live_request(core, ids[1])
    produced = {rid: [] for rid in ids}
    while len(produced[ids[1]]) < 5:
        for output in core.step():
            produced[output.request_id] += output.new_token_ids
        eh.check_pipeline(core)
    assert victim.num_pending == 1 and victim in core.inflight.rows  # its next token is on the device
    [aborted] = core.abort(ids[1])
    assert aborted.finished and aborted.finish_reason == "abort" and aborted.new_token_ids == []
    results, _ = eh.run_checked(core, [ids[0], ids[2], ids[3]])
    assert ids[1] not in results  # no output after the abort
    assert produced[ids[1]] == _expected(LLAMA, prompts[1], 24)[:len(produced[ids[1]])]
    for i in (0, 2, 3):
        assert produced[ids[i]] + results[ids[i]].token_ids == _expected(LLAMA, prompts[i], 24)
    assert victim.status == Status.FINISHED and victim.num_pending == 0
    assert eh.blocks_in_use(core.kv) == 0
    core.kv.check_integrity()


def test_pending_token_counts_for_scheduling_and_min_tokens():
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=3, min_tokens=2), frozenset({0}))
    request.append_token(9)
    request.num_pending = 1
    assert (request.num_tokens, request.num_known_tokens, request.num_output_tokens) == (5, 4, 2)
    assert not request.last_token_pending(max_seq_len=100)
    request.num_pending += 1  # transiently, while the step before is postprocessed
    assert request.last_token_pending(max_seq_len=100)
    request.num_pending = 1
    assert request.last_token_pending(max_seq_len=5)
