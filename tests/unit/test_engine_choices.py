"""n choices per request on one engine (server/engine/choices.py): the prompt is computed once and
its KV shared; every choice is exact against transformers (tiny-llama, and tiny-qwen3-swa's sliding
window), with and without async scheduling, under preemption and speculative decoding; aborts and
failures end what they should; every block comes back."""

from __future__ import annotations

import engine_harness as eh
import hf_reference
import pytest
from prompts import random_prompt

from kvcache import KvCacheConfig
from server.engine.request import Status
from server.models.builtin import resolve_model
from server.types import DisaggParams, GenerateRequest, SamplingParams

LLAMA, SWA = "builtin:tiny-llama", "builtin:tiny-qwen3-swa"


def _expected(model: str, prompt: list[int], n: int) -> list[int]:
    return hf_reference.hf_greedy(resolve_model(model), prompt, n)


def _assert_done(core) -> None:
    assert eh.blocks_in_use(core.kv) == 0 and core.kv.request_ids() == []
    core.kv.check_integrity()


@pytest.mark.parametrize(("model", "async_scheduling"), [(LLAMA, False), (LLAMA, True), (SWA, False), (SWA, True)])
def test_greedy_choices_all_equal_transformers(model, async_scheduling):
    core = eh.make_core(model, async_scheduling=async_scheduling)
    prompt = random_prompt(1, 37)  # two full blocks and a partly filled one
    rid = eh.submit(core, prompt, eh.greedy(10, n=3))
    results = eh.run_choices(core, [rid])
    assert sorted(results) == [(rid, 0), (rid, 1), (rid, 2)]
    for i in range(3):
        final = results[rid, i].final
        assert results[rid, i].token_ids == _expected(model, prompt, 10)
        assert (final.index, final.finish_reason, final.completion_tokens, final.prompt_tokens,
                final.cached_tokens) == (i, "length", 10, 37, 0)
    assert results[rid, 0].text == results[rid, 1].text == results[rid, 2].text != ""
    _assert_done(core)


def test_the_prompt_is_computed_once_and_its_full_blocks_are_held_once():
    core = eh.make_core(LLAMA)
    prompt = random_prompt(2, 40)  # blocks of 16: two full, the third holds 8 tokens
    rid = eh.submit(core, prompt, eh.greedy(12, n=4))
    outputs = core.step()  # the prompt in one step, then four first tokens from one logits row
    assert eh.blocks_in_use(core.kv) == 2 + 4  # the full blocks once, a partly filled block per choice
    ids = [core.kv.block_ids(rid if i == 0 else f"{rid}/{i}") for i in range(4)]
    assert len({tuple(b[:2]) for b in ids}) == 1 and len({b[2] for b in ids}) == 4
    assert all(len(b) == 3 for b in ids)
    assert core.kv.stats().prefix_query_tokens == 40  # one admission: the children were forked
    want = _expected(LLAMA, prompt, 12)
    results = eh.run_choices(core, [rid])
    for i in range(4):
        produced = [t for o in outputs if o.index == i for t in o.new_token_ids] + results[rid, i].token_ids
        assert produced == want
    _assert_done(core)
    again = eh.submit(core, prompt, eh.greedy(12, n=4))
    assert core.step() == [] and eh.blocks_in_use(core.kv) == 2 + 4
    results = eh.run_choices(core, [again])
    # the two full blocks, and 7 tokens of the third (cached full, with the first choice's output)
    assert [results[again, i].final.cached_tokens for i in range(4)] == [39] * 4
    assert core.kv.stats().prefix_query_tokens == 80
    _assert_done(core)


def test_seeded_choices_differ_and_repeat_run_to_run():
    prompt = random_prompt(3, 21)
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=1234, n=3, min_tokens=8)
    runs = []
    for async_scheduling in (False, False, True):
        core = eh.make_core(LLAMA, async_scheduling=async_scheduling)
        rid = eh.submit(core, prompt, params)
        results = eh.run_choices(core, [rid])
        runs.append([results[rid, i].token_ids for i in range(3)])
        _assert_done(core)
    assert runs[0] == runs[1] == runs[2]
    assert len({tuple(tokens) for tokens in runs[0]}) == 3  # each choice draws its own noise
    assert all(len(tokens) == 8 for tokens in runs[0])


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_abort_ends_every_choice_and_frees_every_block(async_scheduling):
    core = eh.make_core(LLAMA, async_scheduling=async_scheduling)
    prompt = random_prompt(4, 30)
    other = eh.submit(core, random_prompt(5, 20), eh.greedy(12))
    rid = eh.submit(core, prompt, eh.greedy(40, n=3))
    produced: dict[tuple[str, int], list[int]] = {(rid, i): [] for i in range(3)} | {(other, 0): []}
    while min(len(produced[rid, i]) for i in range(3)) < 3:
        for output in core.step():
            produced[output.request_id, output.index] += output.new_token_ids
        eh.check_pipeline(core)
    aborted = core.abort(rid)
    assert [(o.request_id, o.index, o.finished, o.finish_reason) for o in aborted] == \
        [(rid, i, True, "abort") for i in range(3)]
    assert core.abort(rid) == []
    results = eh.run_choices(core, [other])
    assert sorted(results) == [(other, 0)]  # nothing of the aborted request follows its abort outputs
    assert produced.pop((other, 0)) + results[other, 0].token_ids == _expected(LLAMA, random_prompt(5, 20), 12)
    for tokens in produced.values():
        assert tokens == _expected(LLAMA, prompt, 40)[:len(tokens)]
    _assert_done(core)
    waiting = eh.submit(core, prompt, eh.greedy(4, n=3))  # before its fork: all three end with it
    assert [(o.index, o.finish_reason) for o in core.abort(waiting)] == [(0, "abort"), (1, "abort"), (2, "abort")]
    assert not core.has_work()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_two_choices_under_preemption_in_a_tiny_pool(async_scheduling):
    kv = KvCacheConfig(tokens_per_block=16, max_tokens=6 * 16)
    core = eh.make_core(LLAMA, kv=kv, async_scheduling=async_scheduling)
    first, prompt = random_prompt(6, 40), random_prompt(7, 40)
    a = eh.submit(core, first, eh.greedy(30))
    b = eh.submit(core, prompt, eh.greedy(30, n=2))
    core.step()  # both prompts (3 blocks each) fill the pool: b's second choice gets no block for its copy
    child = eh.live_request(core, f"{b}/1")
    assert child.status == Status.WAITING and child in core.scheduler.waiting
    assert child.num_computed_tokens == 0
    results = eh.run_choices(core, [a, b])
    assert results[a, 0].token_ids == _expected(LLAMA, first, 30)
    assert results[b, 0].token_ids == results[b, 1].token_ids == _expected(LLAMA, prompt, 30)
    assert core.scheduler.num_preemptions > 0
    _assert_done(core)


def test_speculative_decoding_verifies_each_choice():
    prompt = random_prompt(8, 26)
    want = _expected(LLAMA, prompt, 16)
    core = eh.with_replay_drafts(eh.make_core(LLAMA), {tuple(prompt): want}, wrong=3)
    rid = eh.submit(core, prompt, eh.greedy(16, n=2))
    results = eh.run_choices(core, [rid])
    assert results[rid, 0].token_ids == results[rid, 1].token_ids == want
    assert core.spec.stats.verified >= 4 and 0 < core.spec.stats.accepted < core.spec.stats.proposed
    _assert_done(core)


def test_a_failed_choice_ends_alone():
    core = eh.make_core(LLAMA)
    prompt = random_prompt(9, 33)
    rid = eh.submit(core, prompt, eh.greedy(12, n=3))
    core.step()
    child = eh.live_request(core, f"{rid}/1")
    [failed] = core.fail(child, "out of luck", 503)
    assert (failed.request_id, failed.index, failed.finish_reason, failed.error, failed.error_code) == \
        (rid, 1, "error", "out of luck", 503)
    results = eh.run_choices(core, [rid])
    assert sorted(results) == [(rid, 0), (rid, 2)]
    assert results[rid, 0].token_ids == results[rid, 2].token_ids == _expected(LLAMA, prompt, 12)
    _assert_done(core)


def test_refusals_answer_every_choice():
    core = eh.make_core(LLAMA, max_batch_size=4)
    prompt = random_prompt(10, 12)
    refused = core.add_request(GenerateRequest("ctx", prompt, eh.greedy(4, n=3), DisaggParams("context_only")))
    assert [(o.request_id, o.index, o.finish_reason, o.error_code) for o in refused] == \
        [("ctx", i, "error", 400) for i in range(3)]
    big = eh.submit(core, prompt, eh.greedy(4, n=5))
    fits = eh.submit(core, prompt, eh.greedy(4, n=4))
    results = eh.run_choices(core, [big, fits])
    assert [results[big, i].final.error_code for i in range(5)] == [400] * 5
    assert "n=5 choices" in results[big, 0].final.error and "max_batch_size is 4" in results[big, 4].final.error
    assert [results[fits, i].final.finish_reason for i in range(4)] == ["length"] * 4
    _assert_done(core)


def test_choices_wait_for_rows_of_the_batch():
    """A request with n choices is admitted only when n rows of the batch are free."""
    core = eh.make_core(LLAMA, max_batch_size=4)
    prompts = [random_prompt(20 + i, 15) for i in range(3)]
    singles = [eh.submit(core, p, eh.greedy(6)) for p in prompts[:2]]
    pair = eh.submit(core, prompts[2], eh.greedy(6, n=3))
    core.step()
    assert [r.request_id for r in core.scheduler.running] == singles and len(core.scheduler.waiting) == 1
    results = eh.run_choices(core, [*singles, pair])
    for i in range(3):
        assert results[pair, i].token_ids == _expected(LLAMA, prompts[2], 6)
    _assert_done(core)
