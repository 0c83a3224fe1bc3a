"""Structured output across a disaggregated pair, a moved stream and speculative decoding (tiny-llama):
the context server constrains the first token, the generation server feeds it to its grammar before
constraining the next, and the pair's output is the aggregated one; a moved stream goes on from its
prior output; constrained requests never draft while the others do."""

from __future__ import annotations

import json
import random

import engine_harness as eh
import hf_reference
import pytest
from json_schemas import check, random_schema
from prompts import random_prompt

from kvcache import KvCacheConfig
from server.models.builtin import resolve_model
from server.types import DisaggParams, GenerateRequest, SamplingParams, StructuredSpec

LLAMA = "builtin:tiny-llama"


def _schemas(n: int) -> list[dict]:
    rng = random.Random(21)
    return [random_schema(rng) for _ in range(n)]


def _params(schema: dict) -> SamplingParams:
    return SamplingParams(max_tokens=300, temperature=0.0, structured=StructuredSpec("json_schema", json.dumps(schema)))


def _aggregated(requests: list[tuple[list[int], SamplingParams]]) -> list[eh.Result]:
    core = eh.make_core(LLAMA)
    ids = [eh.submit(core, prompt, params) for prompt, params in requests]
    results = eh.run_to_completion(core, ids)
    return [results[i] for i in ids]


@pytest.fixture
def run():
    with eh.loopback_pair(LLAMA, async_scheduling=True) as pair:
        yield pair


def test_the_pair_gives_the_aggregated_constrained_output(run):
    ctx, gen = run.cores
    schemas, prompts = _schemas(6), [random_prompt(40 + i, 5 + 7 * i) for i in range(6)]
    expected = _aggregated([(p, _params(s)) for p, s in zip(prompts, schemas, strict=True)])
    legs = [eh.submit(ctx, p, _params(s), disagg=DisaggParams("context_only"))
            for p, s in zip(prompts, schemas, strict=True)]
    run.wait(legs, "the context legs")
    for rid, want in zip(legs, expected, strict=True):
        assert run.final(rid).finish_reason is None and run.tokens(rid) == want.token_ids[:1]
    gens = [eh.submit(gen, p, _params(s), disagg=eh.generation_params(run.final(rid)))
            for rid, p, s in zip(legs, prompts, schemas, strict=True)]
    run.wait(gens, "the generation legs")
    for rid, want, schema in zip(gens, expected, schemas, strict=True):
        assert run.tokens(rid) == want.token_ids and run.final(rid).finish_reason == "stop"
        check(json.loads("".join(o.new_text for o in run.outputs[rid])), schema)
    for core in run.cores:
        assert eh.blocks_in_use(core.kv) == 0


def test_a_streamed_pull_feeds_the_first_token_that_comes_with_the_kv_to_the_grammar():
    """kv_stream: the generation leg is added before the first token exists; it arrives with the KV."""
    kv = KvCacheConfig(tokens_per_block=16, max_tokens=4096)
    with eh.loopback_pair(LLAMA, kv=kv, ctx={"max_num_tokens": 32}) as run:
        schema, prompt = _schemas(2)[1], random_prompt(33, 150)
        [want] = _aggregated([(prompt, _params(schema))])
        ctx_id = eh.submit(run.ctx, prompt, _params(schema), disagg=DisaggParams("context_only", kv_stream=True))
        streamed = DisaggParams("generation_only", ctx_id, run.sender.endpoint, run.sender.epoch,
                                prompt_token_ids=tuple(prompt), kv_stream=True)
        gen_id = eh.submit(run.gen, prompt, _params(schema), disagg=streamed)
        run.wait([ctx_id, gen_id], "both legs")
        assert run.tokens(gen_id) == want.token_ids and run.final(gen_id).finish_reason == "stop"


def test_a_grammar_complete_at_the_first_token_ends_on_the_context_server(run):
    ctx = run.ctx
    tokenizer = ctx.tokenizer
    single = [c for c in ("a", "b", "c", "d", "e") if len(tokenizer.encode(c, add_special_tokens=False)) == 1]
    params = SamplingParams(max_tokens=5, temperature=0.0, structured=StructuredSpec("choice", json.dumps(single)))
    rid = eh.submit(ctx, random_prompt(7, 12), params, disagg=DisaggParams("context_only"))
    run.wait([rid], "the context leg")
    answer = run.final(rid)
    assert (answer.finish_reason, answer.disagg) == ("stop", None) and answer.new_text in single
    assert ctx.connector.sender.num_leases == 0 and eh.blocks_in_use(ctx.kv) == 0


def test_first_tokens_that_break_the_grammar_are_refused_with_a_400(run):
    gen = run.gen
    [bad] = gen.tokenizer.encode("x", add_special_tokens=False)
    params = SamplingParams(max_tokens=5, structured=StructuredSpec("choice", '["yes", "no"]'))
    disagg = DisaggParams("generation_only", "lease", "tcp://127.0.0.1:1", "epoch", (bad,), (1, 2, 3))
    [answer] = gen.add_request(GenerateRequest("bad", [1, 2, 3], params, disagg=disagg))
    assert (answer.finish_reason, answer.error_code) == ("error", 400)
    assert answer.error == "disaggregated_params: the output so far does not match the choice"


def test_a_moved_stream_goes_on_from_its_prior_output():
    schema, prompt = _schemas(1)[0], random_prompt(77, 9)
    [whole] = _aggregated([(prompt, _params(schema))])
    assert len(whole.token_ids) > 6
    moved = prompt + whole.token_ids[:5]  # the router resends the output so far as the prompt's tail
    core = eh.make_core(LLAMA)
    rid = eh.submit(core, moved, _params(schema), disagg=DisaggParams("context_and_generation", prior_output_tokens=5))
    result = eh.run_to_completion(core, [rid])[rid]
    assert result.token_ids == whole.token_ids[5:] and result.final.finish_reason == "stop"


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_constrained_requests_do_not_draft_while_the_others_do(async_scheduling):
    free = [random_prompt(90 + i, 20) for i in range(2)]
    model = resolve_model(LLAMA)
    expected = {tuple(p): hf_reference.hf_greedy(model, p, 30) for p in free}
    schemas, prompts = _schemas(3), [random_prompt(60 + i, 10) for i in range(3)]
    want = _aggregated([(p, _params(s)) for p, s in zip(prompts, schemas, strict=True)])
    # the drafter knows only the unconstrained prompts: a constrained request asked for drafts fails
    core = eh.with_replay_drafts(eh.make_core(LLAMA, async_scheduling=async_scheduling), expected, wrong=3)
    ids = [eh.submit(core, p, eh.greedy(30)) for p in free]
    ids += [eh.submit(core, p, _params(s)) for p, s in zip(prompts, schemas, strict=True)]
    results = eh.run_to_completion(core, ids)
    assert [results[i].token_ids for i in ids[:2]] == [expected[tuple(p)] for p in free]
    assert [results[i].token_ids for i in ids[2:]] == [w.token_ids for w in want]
    assert core.spec.stats.proposed > 0 and core.spec.stats.accepted > 0
