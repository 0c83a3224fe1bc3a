"""The draft-model drafter: proposals equal the draft model's own greedy continuation, the engine's
output stays transformers' greedy output (a perfect draft: the model itself; a poor one: another
model of the same tokenizer), its draft cache is released with each request."""

from __future__ import annotations

import gc

import engine_harness as eh
import hf_reference
import pytest
from prompts import random_prompt

from server.engine.request import Request
from server.engine.speculative.config import SpeculativeConfig
from server.engine.speculative.draft_model import build_draft_drafter
from server.models.builtin import resolve_model
from server.types import SamplingParams

LLAMA = "builtin:tiny-llama"
SWA = "builtin:tiny-qwen3-swa"


def _config(draft: str, k: int = 4) -> SpeculativeConfig:
    return SpeculativeConfig(method="draft_model", draft_model=draft, num_speculative_tokens=k)


def test_proposals_are_the_draft_models_greedy_continuation_and_follow_rollbacks():
    target = eh.make_core(LLAMA).runner
    drafter = build_draft_drafter(LLAMA, target, 512, 4)
    prompts = [random_prompt(1, 20), random_prompt(2, 37)]
    expected = [hf_reference.hf_greedy(resolve_model(LLAMA), p, 12) for p in prompts]
    requests = [Request(f"r{i}", p, SamplingParams(), frozenset()) for i, p in enumerate(prompts)]
    assert drafter.propose(requests, [4, 3]) == [expected[0][:4], expected[1][:3]]
    requests[0].append_token(expected[0][0])  # one accepted, then a different token: 2 drafts dropped
    requests[0].append_token(expected[0][1] ^ 1)
    requests[1].append_token(expected[1][0])
    reference = hf_reference.hf_greedy(resolve_model(LLAMA), requests[0].all_token_ids, 4)
    assert drafter.propose(requests, [4, 2]) == [reference, expected[1][1:3]]
    assert drafter._drafts[requests[0]].ids == requests[0].all_token_ids + reference[:3]
    assert drafter.propose(requests[:1], [0]) == [[]]
    in_use = lambda: sum(n for (_, _, state), n in drafter.kv.stats().blocks.items() if state == "in_use")
    assert in_use() > 0
    del requests
    gc.collect()
    assert in_use() == 0 and drafter.kv.request_ids() == []


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_model_as_its_own_draft_accepts_everything_and_matches_transformers(async_scheduling):
    prompts = [random_prompt(10 + i, n) for i, n in enumerate([3, 29, 70])]
    core = eh.make_core(LLAMA, speculative=_config(LLAMA), async_scheduling=async_scheduling)
    results = eh.generate(core, prompts, eh.greedy(30))
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == hf_reference.hf_greedy(resolve_model(LLAMA), prompt, 30)
    stats = core.spec.stats
    assert stats.proposed > 0 and stats.accepted == stats.proposed
    assert stats.emitted >= 4 * stats.verified  # most steps emit k + 1 tokens
    assert eh.blocks_in_use(core.kv) == 0
    core.kv.check_integrity()


def test_another_model_of_the_same_tokenizer_as_draft_keeps_the_vswa_output():
    prompts = [random_prompt(20, 50), random_prompt(21, 90)]  # past the 64-token window
    core = eh.make_core(SWA, speculative=_config(LLAMA))
    results = eh.generate(core, prompts, eh.greedy(40))
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == hf_reference.hf_greedy(resolve_model(SWA), prompt, 40)
    assert core.spec.stats.verified > 0


def test_seeded_sampling_with_a_draft_model_equals_no_speculation():
    prompts = [random_prompt(30, 16), random_prompt(31, 9)]
    params = SamplingParams(max_tokens=24, temperature=0.2, seed=11)  # close to greedy: greedy drafts land
    plain = [r.token_ids for r in eh.generate(eh.make_core(LLAMA), prompts, params)]
    core = eh.make_core(LLAMA, speculative=_config(LLAMA))
    assert [r.token_ids for r in eh.generate(core, prompts, params)] == plain
    assert core.spec.stats.accepted > 0


def test_a_draft_model_of_another_vocabulary_is_refused():
    target = eh.make_core("builtin:tiny-story").runner
    with pytest.raises(ValueError, match="speculative.draft_model: builtin:tiny-llama has a vocabulary"):
        build_draft_drafter(LLAMA, target, 512, 4)
