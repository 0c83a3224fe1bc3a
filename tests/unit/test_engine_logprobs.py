"""Log-probabilities through the engine, against transformers' log_softmax of its own logits: the
sampled tokens' (aggregated, a context + generation pair, speculative verify rows, async scheduling
on and off) and the prompt's (a prompt of several prefill chunks, never taken from the prefix cache,
and on the context server)."""

from __future__ import annotations

import engine_harness as eh
import hf_reference
import pytest
import torch
from prompts import random_prompt
from sampling_harness import logprobs_of, outputs_of, tokens_of

from server.models.builtin import resolve_model
from server.types import DisaggParams, SamplingParams, TokenLogprob

LLAMA = "builtin:tiny-llama"
SWA = "builtin:tiny-qwen3-swa"
MOE = ["builtin:tiny-mixtral", "builtin:tiny-qwen2-moe", "builtin:tiny-qwen3-moe"]
V3 = "builtin:tiny-deepseek-v3"
GLM = "builtin:tiny-glm4-moe"


def check_against_transformers(model: str, prompt: list[int], tokens: list[int],
                               entries: list[TokenLogprob | None], k: int, start: int) -> None:
    """entries[i] is position start + i of prompt + tokens: its token, logprob and top k equal
    log_softmax of transformers' logits of the position before, within 1e-4."""
    sequence = prompt + tokens
    reference = torch.log_softmax(hf_reference.hf_logits(resolve_model(model), sequence), dim=-1)
    assert len(entries) == len(sequence) - start
    for i, entry in enumerate(entries):
        position = start + i
        row = reference[position - 1]
        assert entry.token_id == sequence[position]
        assert entry.logprob == pytest.approx(row[sequence[position]].item(), abs=1e-4)
        top = row.topk(k)
        assert [t for t, _ in entry.top] == top.indices.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in entry.top]), top.values, atol=1e-4, rtol=0)


@pytest.mark.parametrize("model", [LLAMA, SWA, *MOE, V3, GLM])
def test_sampled_tokens_logprobs_equal_transformers(model):
    """A batch of greedy and seeded sampling rows asking 0, 5 and 20 alternatives, beside a row
    that asks none (SWA: past its window of 64)."""
    core = eh.make_core(model)
    prompts = [random_prompt(1, 12), random_prompt(2, 70), random_prompt(3, 5), random_prompt(4, 9)]
    params = [eh.greedy(12, logprobs=5), SamplingParams(max_tokens=12, temperature=1.1, seed=3, logprobs=20),
              SamplingParams(max_tokens=12, temperature=0.7, top_k=20, min_tokens=12, logprobs=0), eh.greedy(12)]
    ids = [eh.submit(core, p, sp) for p, sp in zip(prompts, params, strict=True)]
    outs = outputs_of(core, ids)
    for prompt, sp, rid in zip(prompts[:3], params[:3], ids[:3], strict=True):
        tokens = tokens_of(outs[rid])
        check_against_transformers(model, prompt, tokens, logprobs_of(outs[rid]), sp.logprobs, len(prompt))
        assert all(o.prompt_logprobs is None for o in outs[rid])
    assert tokens_of(outs[ids[0]]) == hf_reference.hf_greedy(resolve_model(model), prompts[0], 12)
    assert all(o.logprobs is None for o in outs[ids[3]])


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("model", [LLAMA, SWA, V3])
def test_prompt_logprobs_of_a_chunked_prompt_equal_transformers(model, async_scheduling):
    """A 90-token prompt in chunks of at most 32 tokens: every position's logprob, once, on the first
    output; its blocks were cached by the request before, yet none is reused for it (positions
    reused from the cache have no logits), while the request after it reuses them."""
    prompt = random_prompt(11, 90)
    core = eh.make_core(model, max_num_tokens=32, async_scheduling=async_scheduling)
    first = outputs_of(core, [eh.submit(core, prompt, eh.greedy(4))])
    asked = SamplingParams(max_tokens=4, temperature=0.0, min_tokens=4, logprobs=2, prompt_logprobs=3)
    rid = eh.submit(core, prompt, asked)
    outs = outputs_of(core, [rid])[rid]
    assert outs[0].prompt_logprobs is not None and all(o.prompt_logprobs is None for o in outs[1:])
    assert outs[0].prompt_logprobs[0] is None
    check_against_transformers(model, prompt, [], outs[0].prompt_logprobs[1:], 3, 1)
    tokens = tokens_of(outs)
    assert tokens == tokens_of(next(iter(first.values())))
    check_against_transformers(model, prompt, tokens, logprobs_of(outs), 2, len(prompt))
    assert outs[-1].cached_tokens == 0
    again = next(iter(outputs_of(core, [eh.submit(core, prompt, eh.greedy(4))]).values()))
    assert again[-1].cached_tokens > 0 and tokens_of(again) == tokens
    assert eh.blocks_in_use(core.kv) == 0


def test_a_one_token_prompt_has_only_the_first_entry():
    core = eh.make_core(LLAMA)
    rid = eh.submit(core, [42], eh.greedy(3, prompt_logprobs=2))
    outs = outputs_of(core, [rid])[rid]
    assert outs[0].prompt_logprobs == [None]


@pytest.mark.parametrize("model", [LLAMA, SWA])
def test_verify_rows_give_the_logprobs_of_plain_steps(model):
    """Speculative decoding with partly wrong drafts: each emitted token's logprobs are those of its
    own verify row, equal to transformers' (and the tokens to the non-speculative output)."""
    prompts = [random_prompt(21, 14), random_prompt(22, 40)]
    params = eh.greedy(30, logprobs=4)
    expected = {tuple(p): hf_reference.hf_greedy(resolve_model(model), p, 30) for p in prompts}
    core = eh.with_replay_drafts(eh.make_core(model), expected, wrong=3)
    ids = [eh.submit(core, p, params) for p in prompts]
    outs = outputs_of(core, ids)
    for prompt, rid in zip(prompts, ids, strict=True):
        assert tokens_of(outs[rid]) == expected[tuple(prompt)]
        check_against_transformers(model, prompt, expected[tuple(prompt)], logprobs_of(outs[rid]), 4, len(prompt))
    assert 0 < core.spec.stats.accepted < core.spec.stats.proposed


def test_async_scheduling_on_and_off_give_the_same_tokens_and_logprobs():
    """A mixed batch (penalties, seeds, logit_bias, prompt logprobs over several chunks) decoding
    beside prefill chunks: the pipelined engine gives what the plain one gives."""
    prompts = [random_prompt(31, 50), random_prompt(32, 8), random_prompt(33, 20), random_prompt(34, 45)]
    params = [SamplingParams(max_tokens=16, temperature=0.9, seed=5, frequency_penalty=0.8, logprobs=3),
              eh.greedy(16, repetition_penalty=1.3, logit_bias=((7, 4.0),), logprobs=1),
              SamplingParams(max_tokens=16, temperature=1.2, min_p=0.1, seed=9, presence_penalty=1.0),
              eh.greedy(16, prompt_logprobs=2, logprobs=0)]
    runs = []
    for async_scheduling in (False, True):
        core = eh.make_core(LLAMA, max_num_tokens=24, async_scheduling=async_scheduling)
        ids = [eh.submit(core, p, sp) for p, sp in zip(prompts, params, strict=True)]
        outs = outputs_of(core, ids)
        runs.append([(tokens_of(outs[rid]), [o.logprobs for o in outs[rid]], [o.prompt_logprobs for o in outs[rid]])
                     for rid in ids])
        assert len(core.counts) == 0 and eh.blocks_in_use(core.kv) == 0
    plain, pipelined = runs
    for (tokens, logprobs, prompt_lps), (tokens2, logprobs2, prompt_lps2) in zip(plain, pipelined, strict=True):
        assert tokens == tokens2
        _assert_close_entries([e for o in logprobs if o for e in o], [e for o in logprobs2 if o for e in o])
        _assert_close_entries([e for o in prompt_lps if o for e in o], [e for o in prompt_lps2 if o for e in o])


def _assert_close_entries(a: list[TokenLogprob | None], b: list[TokenLogprob | None]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        if x is None or y is None:
            assert x is y
            continue
        assert (x.token_id, [t for t, _ in x.top]) == (y.token_id, [t for t, _ in y.top])
        assert x.logprob == pytest.approx(y.logprob, abs=1e-5)
        assert [v for _, v in x.top] == pytest.approx([v for _, v in y.top], abs=1e-5)


@pytest.fixture(params=[LLAMA, *MOE])
def run(request):
    with eh.loopback_pair(request.param, ctx={"max_num_tokens": 32}) as pair:
        pair.model = request.param
        yield pair


def test_a_context_and_generation_pair_gives_every_logprob(run):
    """The context server's answer has the prompt's logprobs (a prompt of several chunks) and the
    first token's; the generation server's the others' (its first output holds the context server's
    token, which it did not sample: no logprobs)."""
    ctx, gen = run.cores
    prompt = random_prompt(41, 75)
    params = SamplingParams(max_tokens=10, temperature=0.8, seed=13, min_tokens=10, logprobs=3, prompt_logprobs=1)
    leg = eh.submit(ctx, prompt, params, disagg=DisaggParams("context_only"))
    run.wait([leg], "the context leg")
    answer = run.final(leg)
    check_against_transformers(run.model, prompt, [], answer.prompt_logprobs[1:], 1, 1)
    rid = eh.submit(gen, prompt, params, disagg=eh.generation_params(answer))
    run.wait([rid], "the generation leg")
    outs = run.outputs[rid]
    assert outs[0].new_token_ids == answer.new_token_ids and outs[0].logprobs is None
    tokens = answer.new_token_ids + tokens_of(outs[1:])
    assert all(o.prompt_logprobs is None for o in outs)
    check_against_transformers(run.model, prompt, tokens, answer.logprobs + logprobs_of(outs[1:]), 3, len(prompt))
