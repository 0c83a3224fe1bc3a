"""n choices in a disaggregated pair (real KV sender and receiver on loopback): the context leg
prefills once, forks, samples a first token per choice and leases the prompt's blocks once; the
generation leg pulls them once, forks with one first token per choice and decodes every choice;
streamed KV brings one first token per choice. Token for token against transformers and the
aggregated engine; every lease ends and every block comes back."""

from __future__ import annotations

import contextlib

import engine_harness as eh
import hf_reference
import pytest
from prompts import random_prompt
from sampling_harness import tokens_of
from waiting import wait_until

from kvcache import KvCacheConfig
from server.models.builtin import resolve_model
from server.types import DisaggParams, GenerateRequest, RequestOutput, SamplingParams

LLAMA, SWA = "builtin:tiny-llama", "builtin:tiny-qwen3-swa"


class Pair(eh.LoopbackPair):
    def __init__(self, model: str, async_scheduling: bool, chunk: int = 256) -> None:
        kv = KvCacheConfig(tokens_per_block=16, max_tokens=4096)
        super().__init__(eh.make_core(model, kv=kv, max_num_tokens=chunk, async_scheduling=async_scheduling),
                         eh.make_core(model, kv=kv, async_scheduling=async_scheduling))

    def choices(self, rid: str) -> dict[int, list[RequestOutput]]:
        out: dict[int, list[RequestOutput]] = {}
        for output in self.outputs.get(rid, []):
            out.setdefault(output.index, []).append(output)
        return out

    def wait_choices(self, rid: str, n: int, what: str) -> dict[int, list[RequestOutput]]:
        wait_until(lambda: len([o for o in self.outputs.get(rid, []) if o.finished]) == n, 60, what,
                   step=self.step, interval_s=0.001)
        choices = self.choices(rid)
        assert sorted(choices) == list(range(n))
        for outputs in choices.values():  # one final output each, the last
            assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
        return choices

    def settle(self) -> None:
        """`LoopbackPair.settle`, and neither cache holds a request."""
        super().settle()
        for core in self.cores:
            assert core.kv.request_ids() == []


@pytest.fixture
def make_pair():
    with contextlib.ExitStack() as made:
        def make(model: str = LLAMA, async_scheduling: bool = False, chunk: int = 256) -> Pair:
            return made.enter_context(Pair(model, async_scheduling, chunk))

        yield make


def _generation_params(answer: RequestOutput) -> DisaggParams:
    return eh.generation_params(answer, ctx_cached_tokens=answer.disagg.ctx_cached_tokens)


@pytest.mark.parametrize(("model", "async_scheduling"), [(LLAMA, False), (LLAMA, True), (SWA, False)])
def test_one_prefill_one_lease_one_pull_and_every_choice_is_exact(make_pair, model, async_scheduling):
    run = make_pair(model, async_scheduling)
    prompt = random_prompt(1, 37)  # two full blocks of 16 and a partly filled one
    want = hf_reference.hf_greedy(resolve_model(model), prompt, 10)
    ctx_id = eh.submit(run.ctx, prompt, eh.greedy(10, n=3), disagg=DisaggParams("context_only"))
    answers = run.wait_choices(ctx_id, 3, "the context leg")
    params = answers[0][-1].disagg
    assert params.ctx_request_id == ctx_id and params.first_gen_tokens == (want[0],) * 3
    for i, outputs in answers.items():
        [final] = outputs
        assert (final.request_id, final.index, final.new_token_ids, final.finish_reason) == (ctx_id, i, want[:1], None)
        assert final.disagg == params and (final.prompt_tokens, final.completion_tokens) == (37, 1)
    assert run.sender.num_leases == 1
    # the prompt's blocks of each window group, pinned by the lease; the children's are free
    assert eh.blocks_in_use(run.ctx.kv) == 3 * len(run.ctx.kv.window_sizes)
    gen_id = eh.submit(run.gen, prompt, eh.greedy(10, n=3), disagg=_generation_params(answers[0][-1]))
    choices = run.wait_choices(gen_id, 3, "the generation leg")
    for i, outputs in choices.items():
        assert tokens_of(outputs) == want
        final = outputs[-1]
        assert (final.request_id, final.index, final.finish_reason, final.prompt_tokens, final.completion_tokens,
                final.cached_tokens) == (gen_id, i, "length", 37, 10, 0)
    assert run.receiver.stats.transfers_ok == 1
    run.settle()
    local = eh.submit(run.ctx, prompt, eh.greedy(10, n=3))  # the same request aggregated
    results = eh.run_choices(run.ctx, [local])
    assert [results[local, i].token_ids for i in range(3)] == [want] * 3
    run.settle()


def test_first_gen_tokens_are_one_per_choice(make_pair):
    run = make_pair()
    prompt = random_prompt(2, 20)
    params = DisaggParams("generation_only", "c1", run.sender.endpoint, run.sender.epoch, (7,), tuple(prompt))
    refused = run.gen.add_request(GenerateRequest("g", prompt, eh.greedy(4, n=2), params))
    assert [(o.index, o.finish_reason, o.error_code) for o in refused] == [(0, "error", 400), (1, "error", 400)]
    assert "first_gen_tokens holds 1 tokens" in refused[0].error and "(n=2)" in refused[0].error
    assert not run.gen.has_work()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_choices_take_their_own_first_tokens(make_pair, async_scheduling):
    """The generation leg continues each choice from its own first token (first_gen_tokens[i]), and a
    choice whose first token is a stop ends at once while the others decode."""
    run = make_pair(async_scheduling=async_scheduling)
    prompt = random_prompt(3, 45)
    ctx_id = eh.submit(run.ctx, prompt, eh.greedy(8, n=1), disagg=DisaggParams("context_only"))
    run.wait([ctx_id], "the context leg")
    p = run.final(ctx_id).disagg
    firsts = (p.first_gen_tokens[0], 17, 301)
    stop = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, stop_token_ids=(17,), n=3)
    params = DisaggParams("generation_only", p.ctx_request_id, p.ctx_endpoint, p.ctx_epoch, firsts, p.prompt_token_ids)
    gen_id = eh.submit(run.gen, prompt, stop, disagg=params)
    choices = run.wait_choices(gen_id, 3, "the generation leg")
    model = resolve_model(LLAMA)
    assert tokens_of(choices[0]) == hf_reference.hf_greedy_ignore_eos(model, prompt, 8)
    assert [(o.new_token_ids, o.finish_reason) for o in choices[1]] == [([17], "stop")]
    assert tokens_of(choices[2]) == [301] + hf_reference.hf_greedy_ignore_eos(model, prompt + [301], 7)
    run.settle()


@pytest.mark.parametrize("model", [LLAMA, SWA])
def test_streamed_kv_brings_a_first_token_per_choice(make_pair, model):
    run = make_pair(model, chunk=32)  # a 70-token prompt is prefilled (and offered) in three steps
    prompt = random_prompt(4, 70)
    want = hf_reference.hf_greedy(resolve_model(model), prompt, 6)
    ctx_id = eh.submit(run.ctx, prompt, eh.greedy(6, n=3), disagg=DisaggParams("context_only", kv_stream=True))
    params = DisaggParams("generation_only", ctx_id, run.sender.endpoint, run.sender.epoch,
                          prompt_token_ids=tuple(prompt), kv_stream=True)
    gen_id = eh.submit(run.gen, prompt, eh.greedy(6, n=3), disagg=params)
    choices = run.wait_choices(gen_id, 3, "the generation leg")
    assert [tokens_of(choices[i]) for i in range(3)] == [want] * 3
    answers = run.wait_choices(ctx_id, 3, "the context answers")
    assert [a[-1].disagg.first_gen_tokens for a in answers.values()] == [(want[0],) * 3] * 3
    assert all(a[-1].disagg.kv_stream for a in answers.values())
    run.settle()


def test_an_abort_of_the_generation_leg_ends_every_choice(make_pair):
    run = make_pair(async_scheduling=True)
    prompt = random_prompt(5, 30)
    ctx_id = eh.submit(run.ctx, prompt, eh.greedy(40, n=3), disagg=DisaggParams("context_only"))
    answers = run.wait_choices(ctx_id, 3, "the context leg")
    gen_id = eh.submit(run.gen, prompt, eh.greedy(40, n=3), disagg=_generation_params(answers[0][-1]))
    wait_until(lambda: all(len(tokens_of(o)) >= 3 for o in run.choices(gen_id).values())
               and len(run.choices(gen_id)) == 3, 60, "three tokens of each choice", step=run.step, interval_s=0.001)
    aborted = run.gen.abort(gen_id)
    assert [(o.index, o.finish_reason) for o in aborted] == [(0, "abort"), (1, "abort"), (2, "abort")]
    run.settle()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_seeded_choices_with_logprobs_and_a_penalty_equal_aggregated(make_pair, async_scheduling):
    """n=3 sampled with a seed (noise keyed by seed, choice and position), a frequency penalty (the
    first token counted on the generation leg) and logprobs: the pair's choices equal the aggregated
    engine's token for token, and their logprobs too (the first token's from the context leg)."""
    run = make_pair(async_scheduling=async_scheduling)
    prompt = random_prompt(6, 41)
    sampling = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=1234, n=3, ignore_eos=True,
                              frequency_penalty=0.7, logprobs=2)
    local = eh.submit(run.ctx, prompt, sampling)
    aggregated = run.wait_choices(local, 3, "the aggregated request")
    run.settle()
    ctx_id = eh.submit(run.ctx, prompt, sampling, disagg=DisaggParams("context_only"))
    answers = run.wait_choices(ctx_id, 3, "the context leg")
    gen_id = eh.submit(run.gen, prompt, sampling, disagg=_generation_params(answers[0][-1]))
    choices = run.wait_choices(gen_id, 3, "the generation leg")
    want = {i: tokens_of(aggregated[i]) for i in range(3)}
    assert len({tuple(t) for t in want.values()}) == 3  # the choices differ from each other
    for i in range(3):
        assert tokens_of(choices[i]) == want[i]
        first = answers[i][-1].logprobs  # the context leg's entry of choice i's first token
        later = [e for o in choices[i] for e in (o.logprobs or [])]
        pair = [*first, *later]
        expected = [e for o in aggregated[i] for e in o.logprobs]
        assert [e.token_id for e in pair] == want[i] and len(pair) == len(expected)
        for got, ref in zip(pair, expected, strict=True):
            assert abs(got.logprob - ref.logprob) < 1e-4 and [t for t, _ in got.top] == [t for t, _ in ref.top]
    run.settle()
