"""Speculative decoding in the engine: output token for token equal to transformers generate and to
the engine without speculation, exact KV state after a rejection, stops inside an accepted run,
seeded sampling, and the adaptive pause."""

from __future__ import annotations

import engine_harness as eh
import hf_reference
import pytest
from prompts import random_prompt

from kvcache.hashing import block_hashes, request_salt
from server.engine.speculative.config import SpeculativeConfig
from server.engine.speculative.decoder import MIN_BACKOFF, SpecDecoder
from server.models.builtin import resolve_model
from server.telemetry.metrics import ServerMetrics
from server.telemetry.relay import RelayedMetrics, engine_figures
from server.types import SamplingParams

LLAMA = "builtin:tiny-llama"
SWA = "builtin:tiny-qwen3-swa"  # sliding window 64 on half its layers
NGRAM = SpeculativeConfig(method="ngram")


def _replay_core(model: str, expected, wrong: int, k: int = 4, **kwargs):
    return eh.with_replay_drafts(eh.make_core(model, **kwargs), expected, wrong, k)


@pytest.mark.parametrize("model", [LLAMA, SWA])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_verified_drafts_give_transformers_greedy_output(model, async_scheduling):
    """A batch of different lengths (SWA: past its window of 64), drafts partly wrong."""
    prompts = [random_prompt(40 + i, n) for i, n in enumerate([5, 30, 61, 18])]
    expected = {tuple(p): hf_reference.hf_greedy(resolve_model(model), p, 40) for p in prompts}
    core = _replay_core(model, expected, wrong=5, async_scheduling=async_scheduling)
    ids = [eh.submit(core, p, eh.greedy(40)) for p in prompts]
    results = eh.run_to_completion(core, ids)
    for prompt, rid in zip(prompts, ids, strict=True):
        assert results[rid].token_ids == expected[tuple(prompt)]
        assert results[rid].final.completion_tokens == 40
    stats = core.spec.stats
    assert 0 < stats.accepted < stats.proposed  # accepted runs and rejections both happened
    assert stats.emitted == stats.accepted + stats.verified
    assert eh.blocks_in_use(core.kv) == 0
    core.kv.check_integrity()


@pytest.mark.parametrize("model", [LLAMA, SWA])
def test_ngram_greedy_equals_transformers_and_no_speculation(model):
    # repeated patterns, and none
    prompts = [random_prompt(7, 12) * 4, random_prompt(8, 40), random_prompt(9, 5) * 6 + [7, 8]]
    core = eh.make_core(model, speculative=NGRAM)
    results = eh.generate(core, prompts, eh.greedy(48))
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == hf_reference.hf_greedy(resolve_model(model), prompt, 48)
    assert core.spec.stats.verified > 0
    core.kv.check_integrity()


def test_ngram_drafts_get_accepted_on_the_trained_model():
    """tiny-story, the one trained model, repeats itself a little: some n-gram drafts are accepted."""
    model = "builtin:tiny-story"
    prompts = [random_prompt(11 + i, 30) for i in range(3)]
    plain = eh.generate(eh.make_core(model), prompts, eh.greedy(200))
    core = eh.make_core(model, speculative=NGRAM)
    assert [r.token_ids for r in eh.generate(core, prompts, eh.greedy(200))] == [r.token_ids for r in plain]
    assert core.spec.stats.accepted > 0


def _step_tokens(core) -> list[int]:
    return [t for out in core.step() for t in out.new_token_ids]


def test_rejected_drafts_roll_back_and_are_never_cached():
    """tokens_per_block 16, prompt of 29: the first verify computes positions 29..33 across the block
    boundary at 32; only its first draft matches, so the request keeps 31 computed and 32 known
    tokens, holds the 3 blocks reserved for the verify, and only block 0 is cached."""
    prompt = random_prompt(3, 29)
    expected = hf_reference.hf_greedy(resolve_model(LLAMA), prompt, 12)
    core = _replay_core(LLAMA, {tuple(prompt): expected}, wrong=3)  # output positions 2, 5, 8, ... wrong
    rid = eh.submit(core, prompt, eh.greedy(12))
    tokens = _step_tokens(core)  # prefill (its token's output waits for the next step)
    request = eh.live_request(core, rid)
    assert (request.num_computed_tokens, request.num_known_tokens) == (29, 30)
    tokens += _step_tokens(core)  # verify [t29, d1, d2, d3, d4]: d1 right, d2 wrong
    assert tokens == expected[:3]
    assert (request.num_computed_tokens, request.num_known_tokens) == (31, 32)
    assert len(core.kv.block_ids(rid)) == 3  # ceil(34 / 16): the blocks of every verified position stay
    salt = request_salt(core.kv.salt, None)
    assert core.kv.cached_block_hashes() == block_hashes(prompt, 16, salt)[:1]
    tokens += _step_tokens(core)  # verify [t31, d3, d4, d5, d6]: d3, d4 right, d5 wrong
    assert tokens == expected[:6]
    assert (request.num_computed_tokens, request.num_known_tokens) == (34, 35)
    assert core.kv.cached_block_hashes() == block_hashes(request.all_token_ids, 16, salt)[:2]
    results = eh.run_to_completion(core, [rid])
    assert tokens + results[rid].token_ids == expected
    assert eh.blocks_in_use(core.kv) == 0
    core.kv.check_integrity()


def test_max_tokens_and_stops_land_inside_an_accepted_run():
    prompt = random_prompt(5, 20)
    full = eh.generate(eh.make_core(LLAMA), [prompt], eh.greedy(24))[0]
    expected = {tuple(prompt): full.token_ids}
    core = _replay_core(LLAMA, expected, wrong=0)  # every draft right: runs of 5 tokens
    [short] = eh.generate(core, [prompt], eh.greedy(7))
    assert short.token_ids == full.token_ids[:7] and short.final.finish_reason == "length"
    stop_id = full.token_ids[8]
    params = SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=(stop_id,))
    [stopped] = eh.generate(core, [prompt], params)
    assert stopped.token_ids == full.token_ids[:full.token_ids.index(stop_id) + 1]
    assert stopped.final.finish_reason == "stop"
    stop = full.text[10:13]
    params = SamplingParams(max_tokens=24, temperature=0.0, min_tokens=0, stop=(stop,), ignore_eos=True)
    [text] = eh.generate(core, [prompt], params)
    assert text.final.finish_reason == "stop" and text.text == full.text[:full.text.index(stop)]
    assert core.spec.stats.accepted > 0
    assert eh.blocks_in_use(core.kv) == 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_seeded_sampling_is_the_same_with_and_without_speculation(async_scheduling):
    prompts = [random_prompt(21, 16), random_prompt(22, 9)]
    params = SamplingParams(max_tokens=30, temperature=0.8, top_k=40, seed=77, min_tokens=5)
    plain = [r.token_ids for r in eh.generate(eh.make_core(LLAMA), prompts, params)]
    expected = {tuple(p): out for p, out in zip(prompts, plain, strict=True)}
    core = _replay_core(LLAMA, expected, wrong=4, async_scheduling=async_scheduling)
    assert [r.token_ids for r in eh.generate(core, prompts, params)] == plain
    assert core.spec.stats.accepted > 0


def test_drafts_that_fail_pause_the_request():
    """Random text: after MISS_LIMIT misses a request pauses MIN_BACKOFF tokens, then twice as long."""
    prompt = random_prompt(31, 40)
    core = eh.make_core(LLAMA, speculative=NGRAM)
    expected = hf_reference.hf_greedy(resolve_model(LLAMA), prompt, 120)
    [result] = eh.generate(core, [prompt], eh.greedy(120))
    assert result.token_ids == expected
    # each pause of b tokens follows at most 2 draft attempts: 8 + 16 + 32 + 64 > 120 tokens
    assert core.spec.stats.verified <= 2 * 5
    assert MIN_BACKOFF == 8


def test_a_large_decode_batch_does_not_draft():
    prompts = [random_prompt(60 + i, 12) * 3 for i in range(3)]
    expected = {tuple(p): hf_reference.hf_greedy(resolve_model(LLAMA), p, 16) for p in prompts}
    core = eh.make_core(LLAMA)
    core.spec = SpecDecoder(SpeculativeConfig(method="ngram", max_decode_batch=2), core.config,
                            eh.ReplayDrafter(expected))
    results = eh.generate(core, prompts, eh.greedy(16))
    assert [r.token_ids for r in results] == list(expected.values())
    assert core.spec.stats.verified == 0


def test_metrics_count_drafts_and_accepted_tokens():
    prompt = random_prompt(13, 20)
    expected = hf_reference.hf_greedy(resolve_model(LLAMA), prompt, 20)
    core = _replay_core(LLAMA, {tuple(prompt): expected}, wrong=3)
    metrics = ServerMetrics()
    [result] = eh.generate(core, [prompt], eh.greedy(20))
    assert result.token_ids == expected
    RelayedMetrics(metrics).update(engine_figures(core))
    text = metrics.render().decode()
    stats = core.spec.stats
    assert stats.accepted > 0 and stats.verified > 0
    assert f"pdserve_spec_draft_tokens_total {float(stats.proposed)}" in text
    assert f"pdserve_spec_accepted_tokens_total {float(stats.accepted)}" in text
    assert f"pdserve_spec_emitted_tokens_total {float(stats.emitted)}" in text
    assert f"pdserve_spec_verify_steps_total {float(stats.verified)}" in text
    assert f"pdserve_spec_acceptance_rate {stats.accepted / stats.proposed}" in text
    assert f"pdserve_spec_tokens_per_step {stats.emitted / stats.verified}" in text
    # every output token after the first came from a verify step or a plain decode step
    assert stats.emitted <= 19
