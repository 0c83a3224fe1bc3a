"""Penalties, logit_bias, min_p and position-keyed seeds through the engine, token for token against
a reference loop over transformers' logits written here; and the same output from a context +
generation pair, a moved stream and speculative decoding as from one aggregated engine."""

from __future__ import annotations

import engine_harness as eh
import hf_reference
import pytest
import torch
from prompts import random_prompt
from sampling_harness import outputs_of, tokens_of

from server.engine.sampler import noise_seed
from server.models.builtin import resolve_model
from server.types import DisaggParams, SamplingParams

LLAMA = "builtin:tiny-llama"
SWA = "builtin:tiny-qwen3-swa"
N = 16


def reference(model: str, prompt: list[int], params: SamplingParams, eos: frozenset[int], n: int,
              prior: int = 0) -> list[int]:
    """n tokens by the documented rules over transformers' logits: min_tokens, logit_bias,
    repetition (prompt or output), frequency and presence (output: `prior` last prompt tokens
    included) on the raw logits; greedy argmax, or temperature, min_p, top-k and the exponential race
    with Exp(1) noise from a CPU generator seeded with noise_seed(seed, 0, output position)."""
    out: list[int] = []
    for _ in range(n):
        logits = hf_reference.hf_logits(resolve_model(model), prompt + out)[-1].clone()
        if len(out) < params.min_tokens:
            logits[sorted(eos | set(params.stop_token_ids))] = float("-inf")
        for token, bias in params.logit_bias:
            logits[token] += bias
        output = torch.tensor(prompt[len(prompt) - prior:] + out, dtype=torch.int64)
        counts = torch.bincount(output, minlength=logits.numel()).float()
        seen = counts > 0
        seen[prompt] = True
        rep = params.repetition_penalty
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
        logits = logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()
        out.append(int(logits.argmax()) if params.greedy else _sampled(logits, params, prior + len(out)))
    return out


def _sampled(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    scores = logits / params.temperature
    probs = torch.softmax(scores, dim=-1)
    scores = scores.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    if params.top_k > 0:
        scores = scores.masked_fill(scores < scores.topk(params.top_k).values[-1], float("-inf"))
    generator = torch.Generator().manual_seed(noise_seed(params.seed, 0, position))
    noise = torch.empty(logits.numel()).exponential_(generator=generator)
    return int((scores - noise.log()).argmax())


GREEDY_CASES = {
    "frequency": {"frequency_penalty": 1.5},
    "presence": {"presence_penalty": 2.0},
    "repetition": {"repetition_penalty": 1.6},
    "repetition_below_one": {"repetition_penalty": 0.6},
    "combined": {"frequency_penalty": 0.7, "presence_penalty": 0.5, "repetition_penalty": 1.3},
    "logit_bias": {"logit_bias": ((300, 6.0), (7, -3.0))},
    "bias_and_penalty": {"logit_bias": ((300, 3.0),), "frequency_penalty": 2.0},
}


@pytest.mark.parametrize("model", [LLAMA, SWA])
def test_greedy_with_each_penalty_and_bias_equals_the_reference(model):
    """One batch: each case beside an unpenalised row (greedy = argmax of the penalised logits). The
    prompt repeats tokens, and both models' greedy output repeats prompt and output tokens."""
    prompt, n = random_prompt(4, 20) + random_prompt(4, 20)[:10], 24
    core = eh.make_core(model)
    plain = hf_reference.hf_greedy(resolve_model(model), prompt, n)
    cases = {name: eh.greedy(n, **extra) for name, extra in GREEDY_CASES.items()}
    ids = {name: eh.submit(core, prompt, params) for name, params in cases.items()}
    ids["plain"] = eh.submit(core, prompt, eh.greedy(n))
    outs = outputs_of(core, list(ids.values()))
    assert tokens_of(outs[ids["plain"]]) == plain
    for name, params in cases.items():
        tokens = tokens_of(outs[ids[name]])
        assert tokens == reference(model, prompt, params, core.eos_token_ids, n), name
        assert tokens != plain, name  # the setting changed the output
    assert len(core.counts) == 0


def test_min_p_and_penalties_with_seeded_sampling_equal_the_reference():
    prompt = random_prompt(2, 15)
    core = eh.make_core(LLAMA)
    cases = [SamplingParams(max_tokens=N, temperature=1.5, min_p=0.2, seed=5, min_tokens=N),
             SamplingParams(max_tokens=N, temperature=1.5, seed=5, min_tokens=N),
             SamplingParams(max_tokens=N, temperature=0.9, top_k=30, seed=8, frequency_penalty=1.0,
                            repetition_penalty=1.2, logit_bias=((11, 2.0),), min_tokens=N)]
    ids = [eh.submit(core, prompt, params) for params in cases]
    outs = outputs_of(core, ids)
    results = [tokens_of(outs[rid]) for rid in ids]
    for params, tokens in zip(cases, results, strict=True):
        assert tokens == reference(LLAMA, prompt, params, core.eos_token_ids, N)
    assert results[0] != results[1]  # min_p changed the output


@pytest.fixture
def run():
    with eh.loopback_pair(LLAMA, ctx={"async_scheduling": True}) as pair:  # the generation side plain
        yield pair


PAIR_CASES = [eh.greedy(N, frequency_penalty=1.2, repetition_penalty=1.3),
              SamplingParams(max_tokens=N, temperature=1.0, seed=21, min_tokens=N),
              SamplingParams(max_tokens=N, temperature=0.8, seed=4, presence_penalty=1.5, min_tokens=N)]


def test_a_pair_equals_one_aggregated_engine(run):
    """Penalties count the context server's first token as output, and a seeded row's noise depends
    on its output position, not on which server drew the rows before."""
    ctx, gen = run.cores
    prompts = [random_prompt(10 + i, 12 + 7 * i) for i in range(len(PAIR_CASES))]
    aggregated = eh.make_core(LLAMA)
    ids = [eh.submit(aggregated, p, sp) for p, sp in zip(prompts, PAIR_CASES, strict=True)]
    expected = [tokens_of(o) for o in outputs_of(aggregated, ids).values()]
    gens = run.serve(prompts, PAIR_CASES)
    assert [run.tokens(rid) for rid in gens] == expected
    assert expected[0] == reference(LLAMA, prompts[0], PAIR_CASES[0], aggregated.eos_token_ids, N)
    assert len(ctx.counts) == len(gen.counts) == 0


def test_a_moved_stream_goes_on_as_the_original(run):
    """A stream moved after k tokens (its context leg prefills prompt + those k, `prior_output_tokens`
    = k) goes on with the tokens the unmoved stream had: its prior output counts as output for the
    penalties, and its noise positions go on from k."""
    ctx, gen = run.cores
    prompt, k = random_prompt(30, 14), 6
    params = SamplingParams(max_tokens=N, temperature=1.0, seed=17, frequency_penalty=0.9, min_tokens=N)
    aggregated = eh.make_core(LLAMA)
    expected = tokens_of(next(iter(outputs_of(aggregated, [eh.submit(aggregated, prompt, params)]).values())))
    moved = prompt + expected[:k]
    rest = SamplingParams(max_tokens=N - k, temperature=1.0, seed=17, frequency_penalty=0.9, min_tokens=N - k)
    leg = eh.submit(ctx, moved, rest, disagg=DisaggParams("context_only", prompt_token_ids=tuple(moved),
                                                           prior_output_tokens=k))
    run.wait([leg], "the context leg")
    rid = eh.submit(gen, moved, rest, disagg=eh.generation_params(run.final(leg), prior_output_tokens=k))
    run.wait([rid], "the generation leg")
    assert run.tokens(rid) == expected[k:]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_speculative_decoding_keeps_penalised_and_seeded_output(async_scheduling):
    """Verify rows count the drafts before them as output and draw their position's noise; a
    rejected position is drawn again with the same key."""
    prompts = [random_prompt(50, 16), random_prompt(51, 9)]
    params = [eh.greedy(24, frequency_penalty=0.6, presence_penalty=0.4),
              SamplingParams(max_tokens=24, temperature=0.7, seed=3, repetition_penalty=1.4, min_tokens=24)]
    plain_core = eh.make_core(LLAMA)
    ids = [eh.submit(plain_core, p, sp) for p, sp in zip(prompts, params, strict=True)]
    plain = [tokens_of(o) for o in outputs_of(plain_core, ids).values()]
    expected = {tuple(p): out for p, out in zip(prompts, plain, strict=True)}
    core = eh.with_replay_drafts(eh.make_core(LLAMA, async_scheduling=async_scheduling), expected, wrong=4)
    ids = [eh.submit(core, p, sp) for p, sp in zip(prompts, params, strict=True)]
    assert [tokens_of(o) for o in outputs_of(core, ids).values()] == plain
    assert 0 < core.spec.stats.accepted < core.spec.stats.proposed
    assert len(core.counts) == 0
