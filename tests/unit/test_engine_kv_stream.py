"""Streamed KV between two engines in one process (real KV sender and receiver on loopback): the
generation request is added before its context request has prefilled anything, pulls each block as
a prefill chunk writes it, and gets its first token with the last of them; token for token against
transformers (a full-attention and a sliding-window model, the mixture-of-experts ones, GLM-4.5's
partial rotary, with and without async scheduling).
Aborting both legs mid-prefill, or a context leg that ends at its first token, leaves no lease, no
pin and no block in use on either side."""

from __future__ import annotations

import contextlib

import engine_harness as eh
import hf_reference
import pytest
from prompts import random_prompt
from waiting import wait_until

from kvcache import KvCacheConfig
from server.models.builtin import resolve_model
from server.types import DisaggParams

LLAMA, SWA = "builtin:tiny-llama", "builtin:tiny-qwen3-swa"
MIXTRAL, QWEN2_MOE, QWEN3_MOE = "builtin:tiny-mixtral", "builtin:tiny-qwen2-moe", "builtin:tiny-qwen3-moe"
CHUNK = 32  # the context server prefills 32 tokens per step: a 150-token prompt takes 5 steps


class Pair(eh.LoopbackPair):
    """A context and a generation engine on a real KV sender and receiver, stepped together."""

    def __init__(self, model: str, async_scheduling: bool) -> None:
        kv = KvCacheConfig(tokens_per_block=16, max_tokens=4096)
        super().__init__(eh.make_core(model, kv=kv, max_num_tokens=CHUNK, async_scheduling=async_scheduling),
                         eh.make_core(model, kv=kv, async_scheduling=async_scheduling))

    def legs(self, prompt: list[int], max_tokens: int) -> tuple[str, str]:
        """Both legs at once, as the router starts them for a streamed prompt."""
        ctx_id = eh.submit(self.ctx, prompt, eh.greedy(max_tokens), disagg=DisaggParams("context_only", kv_stream=True))
        params = DisaggParams("generation_only", ctx_id, self.sender.endpoint, self.sender.epoch,
                              prompt_token_ids=tuple(prompt), kv_stream=True)
        return ctx_id, eh.submit(self.gen, prompt, eh.greedy(max_tokens), disagg=params)

    def first_chunks(self, gen_id: str) -> None:
        """One step of both (the first 32 prompt tokens prefilled), then only the generation engine
        steps until their blocks land: the context leg cannot finish meanwhile."""
        self.step()
        wait_until(lambda: self.receiver.stats.bytes_received, 30, "the first chunks",
                   step=lambda: self.outputs.setdefault(gen_id, []).extend(self.gen.step()), interval_s=0.001)
        assert self.final(gen_id) is None


@pytest.fixture
def make_pair():
    with contextlib.ExitStack() as made:
        yield lambda model=LLAMA, async_scheduling=False: made.enter_context(Pair(model, async_scheduling))


@pytest.mark.parametrize(("model", "async_scheduling"), [(LLAMA, False), (LLAMA, True), (SWA, False), (MIXTRAL, False),
                                                      (QWEN2_MOE, True), (QWEN3_MOE, False),
                                                      ("builtin:tiny-deepseek-v3", False),
                                                      ("builtin:tiny-glm4-moe", True)])
def test_streamed_blocks_arrive_during_the_prefill_and_the_output_is_exact(make_pair, model, async_scheduling):
    run = make_pair(model, async_scheduling)
    prompt = random_prompt(11, 150)
    ctx_id, gen_id = run.legs(prompt, 10)
    run.step()  # both legs admitted, the pull sent; the first 32 tokens prefilled: 2 blocks offered
    wait_until(lambda: run.receiver.stats.bytes_received, 10, "a chunk while the prompt is prefilled",
               step=lambda: run.outputs.setdefault(gen_id, []).extend(run.gen.step()), interval_s=0.001)
    assert run.final(ctx_id) is None and eh.live_request(run.ctx, ctx_id).num_computed_tokens < len(prompt)
    run.wait([ctx_id], "the context leg")
    answer = run.final(ctx_id)
    expected = hf_reference.hf_greedy(resolve_model(model), prompt, 10)
    assert answer.disagg.kv_stream and answer.new_token_ids == expected[:1]
    run.wait([gen_id], "the generation leg")
    assert run.tokens(gen_id) == expected and run.final(gen_id).finish_reason == "length"
    run.settle()


def test_aborting_both_legs_mid_prefill_releases_everything(make_pair):
    run = make_pair()
    ctx_id, gen_id = run.legs(random_prompt(12, 200), 5)
    run.first_chunks(gen_id)
    assert run.final(ctx_id) is None and run.sender.pinned_blocks()
    run.gen.abort(gen_id)  # the client left: the router closes both legs
    run.ctx.abort(ctx_id)
    run.settle()


def test_a_context_abort_alone_fails_the_generation_leg(make_pair):
    run = make_pair()
    ctx_id, gen_id = run.legs(random_prompt(13, 200), 5)
    run.first_chunks(gen_id)
    run.ctx.abort(ctx_id)
    run.wait([gen_id], "the generation leg to fail")
    assert run.final(gen_id).finish_reason == "error"
    run.settle()


def test_a_context_leg_ending_at_its_first_token_ends_the_streamed_lease(make_pair):
    run = make_pair()
    ctx_id, gen_id = run.legs(random_prompt(14, 100), 1)
    run.wait([ctx_id, gen_id], "both legs")
    assert run.final(ctx_id).finish_reason == "length" and run.final(ctx_id).disagg is None
    assert run.final(gen_id).finish_reason == "error"  # the router would have closed it already
    run.settle()


def test_a_generation_leg_whose_context_request_was_never_admitted_fails_fast(make_pair):
    """Rejected on the context server (too big for its pool): the pull waiting for its lease is refused."""
    run = make_pair()
    prompt = random_prompt(15, 100)
    params = DisaggParams("generation_only", "never-admitted", run.sender.endpoint, run.sender.epoch,
                          prompt_token_ids=tuple(prompt), kv_stream=True)
    gen_id = eh.submit(run.gen, prompt, eh.greedy(3), disagg=params)
    wait_until(lambda: run.receiver.num_pulls, 10, "the pull", step=run.step, interval_s=0.001)
    run.sender.drop_lease("never-admitted")
    run.wait([gen_id], "the generation leg to fail")
    assert run.final(gen_id).finish_reason == "error"
    run.settle()
