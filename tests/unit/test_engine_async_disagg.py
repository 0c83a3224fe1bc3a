"""A disaggregated pair with async scheduling forced on both engines (real KV sender and receiver on
loopback, tiny-llama): context legs prefilled in batches beside aggregated requests in the pipeline,
generation legs whose KV arrives while other requests decode, and a failed pull, all token for token
against transformers; every lease ends and every block comes back."""

from __future__ import annotations

import dataclasses

import engine_harness as eh
import hf_reference
import pytest
from prompts import random_prompt
from waiting import wait_until

from server.models.builtin import resolve_model
from server.types import DisaggParams

LLAMA = "builtin:tiny-llama"


def _expected(prompt: list[int], n: int) -> list[int]:
    return hf_reference.hf_greedy(resolve_model(LLAMA), prompt, n)


@pytest.fixture
def run():
    with eh.loopback_pair(LLAMA, async_scheduling=True) as pair:
        yield pair


def test_the_pair_is_exact_with_both_pipelines_busy(run):
    ctx, gen = run.cores
    # aggregated requests keep both pipelines full while the legs pass through
    local = {core: eh.submit(core, random_prompt(90 + i, 25), eh.greedy(40)) for i, core in enumerate(run.cores)}
    prompts = [random_prompt(300 + i, n) for i, n in enumerate([5, 40, 33, 70])]
    legs = [eh.submit(ctx, p, eh.greedy(10), disagg=DisaggParams("context_only")) for p in prompts]
    run.wait(legs, "the context legs")
    for rid, prompt in zip(legs, prompts, strict=True):
        answer = run.final(rid)
        assert (answer.finish_reason, answer.new_token_ids) == (None, _expected(prompt, 1))
    gens = [eh.submit(gen, p, eh.greedy(10), disagg=eh.generation_params(run.final(rid)))
            for rid, p in zip(legs, prompts, strict=True)]
    bogus = DisaggParams("generation_only", "no-such-lease", ctx.connector.sender.endpoint, ctx.connector.sender.epoch,
                         (7,), tuple(prompts[0]))
    failed = eh.submit(gen, prompts[0], eh.greedy(10), disagg=bogus)
    run.wait([*gens, failed, *local.values()], "the generation legs")
    for rid, prompt in zip(gens, prompts, strict=True):
        assert run.tokens(rid) == _expected(prompt, 10) and run.final(rid).finish_reason == "length"
    assert (run.final(failed).finish_reason, run.final(failed).error_code) == ("error", 404)
    for i, rid in enumerate(local.values()):
        assert run.tokens(rid) == _expected(random_prompt(90 + i, 25), 40)
    wait_until(lambda: ctx.connector.sender.num_leases == 0, 30, "the leases to end", step=run.step)
    for core in run.cores:
        assert eh.blocks_in_use(core.kv) == 0
        core.kv.check_integrity()


def test_a_context_leg_ending_at_its_first_token_offers_nothing(run):
    """max_tokens 1 (or a stop at the first token) ends the request on the context server itself:
    no lease, no row after the prefill."""
    ctx = run.ctx
    prompt = random_prompt(400, 20)
    rid = eh.submit(ctx, prompt, eh.greedy(1), disagg=DisaggParams("context_only"))
    request = eh.live_request(ctx, rid)
    run.wait([rid], "the context leg")
    assert run.final(rid).finish_reason == "length" and run.tokens(rid) == _expected(prompt, 1)
    assert request.num_computed_tokens == len(prompt)
    assert ctx.connector.sender.num_leases == 0 and eh.blocks_in_use(ctx.kv) == 0


def test_a_prefilled_context_leg_is_handed_over_before_the_next_step_is_scheduled(run):
    """Its KV is offered right after the step that wrote it (not after the next step, which may be
    a long prefill), and its batch slot goes to the next request in that same schedule."""
    ctx = run.ctx
    ctx.scheduler.config = dataclasses.replace(ctx.config, max_batch_size=1)
    leg = eh.submit(ctx, random_prompt(500, 30), eh.greedy(8), disagg=DisaggParams("context_only"))
    waiting = eh.submit(ctx, random_prompt(501, 12), eh.greedy(8))
    after = eh.live_request(ctx, waiting)
    assert ctx.step() == [] and after.num_computed_tokens == 0  # the leg's prefill; the batch is full
    [answer] = ctx.step()
    assert answer.request_id == leg and answer.disagg is not None and ctx.connector.sender.num_leases == 1
    assert after.num_computed_tokens == 12  # prefilled in the step that handed the leg over
    ctx.connector.drop_lease(leg)
    eh.run_to_completion(ctx, [waiting])
