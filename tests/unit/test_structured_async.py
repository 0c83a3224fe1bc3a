"""Structured output under async scheduling (tiny-llama, CPU): the step in flight's tokens are fed to
the grammars once the next forward is queued (`StructuredOutput.feed_ahead`) and found fed when that
step is postprocessed. Every output equals the sync engine's, token for token, greedy and seeded:
grammars that end at the token of the step in flight (the next row's token is dropped), max_tokens
endings, n > 1 choices, an abort while a token is in flight, preemption under a small KV pool, a
disaggregated generation leg, and speculative decoding beside constrained requests."""

from __future__ import annotations

import json
import random

import engine_harness as eh
import pytest
from json_schemas import random_schema
from prompts import random_prompt
from waiting import wait_until

from kvcache import KvCacheConfig
from server.engine.request import Request, Status
from server.engine.speculative.config import SpeculativeConfig
from server.types import DisaggParams, SamplingParams, StructuredSpec

LLAMA = "builtin:tiny-llama"
REGEX = StructuredSpec("regex", r"[a-z]{2,4}-[0-9]{3}")
GRAMMAR = StructuredSpec("grammar", 'root ::= "(" [a-z] ("," [a-z])? ")"')


def _schemas(n: int, seed: int = 7) -> list[StructuredSpec]:
    rng = random.Random(seed)
    return [StructuredSpec("json_schema", json.dumps(random_schema(rng))) for _ in range(n)]


def _params(spec: StructuredSpec, seed: int | None = None, **extra) -> SamplingParams:
    """Greedy without a seed; sampled at temperature 0.9 with one."""
    extra.setdefault("max_tokens", 200)
    return SamplingParams(temperature=0.0 if seed is None else 0.9, seed=seed, structured=spec, **extra)


def _summary(result: eh.Result) -> tuple:
    final = result.final
    return result.token_ids, result.text, final.finish_reason, final.completion_tokens, final.error


def _sync(cases: list[tuple[list[int], SamplingParams]], **core) -> list[tuple]:
    engine = eh.make_core(LLAMA, async_scheduling=False, **core)
    ids = [eh.submit(engine, p, s) for p, s in cases]
    results = eh.run_to_completion(engine, ids)
    return [_summary(results[i]) for i in ids]


def _submit(core, cases: list[tuple[list[int], SamplingParams]]) -> tuple[list[str], list[Request]]:
    """The requests' ids, and the requests (their choices 1.. join them as `children` once forked)."""
    ids = [eh.submit(core, p, s) for p, s in cases]
    return ids, [eh.live_request(core, rid) for rid in ids]


def _grammars_settled(core, requests: list[Request]) -> None:
    """Every step is postprocessed: no grammar of `requests` (or of their choices) holds a token fed
    ahead, and nothing stays allocated."""
    assert core.inflight is None and not core.has_work()
    grammars = [c.grammar for r in requests for c in (r, *r.children) if c.grammar is not None]
    assert grammars and all(not g.ahead for g in grammars)
    assert eh.blocks_in_use(core.kv) == 0
    core.kv.check_integrity()


def _spy_closed_rows(core) -> list[Request]:
    """Records the constrained rows whose grammar had ended when their step's mask was filled."""
    closed, mask = [], core.structured.mask
    def spy(rows):
        closed.extend(r for r in rows if isinstance(r, Request) and r.grammar is not None and not r.grammar.open)
        return mask(rows)
    core.structured.mask = spy
    return closed


def test_a_grammar_that_ends_at_the_step_in_flight_drops_its_next_token():
    """Short grammars (regex, lark) end at a token whose step is in flight while the request already
    has a row in the next step: that row is unmasked, its token dropped, and the request ends "stop"
    with the sync engine's tokens. Stop strings and stop tokens end JSON outputs with the grammar
    still open; unconstrained rows of the same steps are unchanged."""
    prompts = [random_prompt(300 + i, 5 + 3 * i) for i in range(8)]
    cases = [(p, _params(REGEX if i % 2 else GRAMMAR, seed=i if i % 3 else None)) for i, p in enumerate(prompts)]
    json_specs = _schemas(2, seed=19)  # ended by a stop string or a stop token with the grammar open
    cases += [(random_prompt(402, 11), _params(json_specs[0], stop=('":',))),
              (random_prompt(403, 8), _params(json_specs[1], seed=4, stop_token_ids=(16,)))]
    cases += [(random_prompt(400, 9), eh.greedy(20)), (random_prompt(401, 14), eh.greedy(20))]
    core = eh.make_core(LLAMA, async_scheduling=True)
    closed = _spy_closed_rows(core)
    ids, requests = _submit(core, cases)
    results, _ = eh.run_checked(core, ids)
    assert [_summary(results[i]) for i in ids] == _sync(cases)
    assert all(results[i].final.finish_reason == "stop" for i in ids[:10])
    assert {r.request_id for r in closed} == set(ids[:8])  # every one had a row after its grammar ended
    _grammars_settled(core, requests)


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 7])
def test_max_tokens_cuts_a_constrained_output_as_in_sync_mode(max_tokens):
    """A JSON output cut by max_tokens ends "length" at the same token as in sync mode, its last token
    pending without a row (greedy and seeded)."""
    specs = _schemas(4, seed=3)
    cases = [(random_prompt(500 + i, 6 + 2 * i), _params(s, seed=None if i % 2 else 11 + i, max_tokens=max_tokens))
             for i, s in enumerate(specs)]
    core = eh.make_core(LLAMA, async_scheduling=True)
    ids, requests = _submit(core, cases)
    results, _ = eh.run_checked(core, ids)
    summaries = [_summary(results[i]) for i in ids]
    assert summaries == _sync(cases)
    assert all(s[2] == "length" and len(s[0]) == max_tokens for s in summaries)
    _grammars_settled(core, requests)


@pytest.mark.parametrize("seed", [None, 5])
def test_forked_choices_equal_sync_mode(seed):
    """n > 1 choices of constrained requests fork at their first token, each with its own grammar; the
    step in flight then holds every choice's token, each fed to its own grammar: every choice equals
    the sync engine's (greedy: all alike; seeded: each its own noise)."""
    specs = [*_schemas(2, seed=13), REGEX]
    params = [_params(s, seed=None if seed is None else seed + i, n=3, max_tokens=80) for i, s in enumerate(specs)]
    prompts = [random_prompt(600 + i, 7 + 4 * i) for i in range(3)]

    def run(async_scheduling: bool) -> dict:
        core = eh.make_core(LLAMA, async_scheduling=async_scheduling)
        ids, requests = _submit(core, list(zip(prompts, params, strict=True)))
        results = eh.run_choices(core, ids)
        if async_scheduling:
            _grammars_settled(core, requests)
        return {(ids.index(rid), i): _summary(r) for (rid, i), r in results.items()}

    async_, sync = run(True), run(False)
    assert sorted(async_) == [(r, i) for r in range(3) for i in range(3)]
    assert async_ == sync
    if seed is not None:
        assert len({tuple(async_[0, i][0]) for i in range(3)}) > 1  # the choices differ


def test_abort_of_a_constrained_request_whose_token_is_in_flight():
    """The aborted request's token in flight is never fed to its grammar; the others (constrained, one
    with n = 2) go on exactly as in sync mode and every block comes back."""
    specs = _schemas(3, seed=17)
    cases = [(random_prompt(700 + i, 8 + 5 * i), _params(s, seed=None if i != 1 else 3, n=2 if i == 2 else 1))
             for i, s in enumerate(specs)]
    core = eh.make_core(LLAMA, async_scheduling=True)
    ids, requests = _submit(core, cases)
    victim = requests[1]
    produced: dict[tuple[str, int], list[int]] = {}
    while len(produced.get((ids[1], 0), [])) < 4:
        for output in core.step():
            produced.setdefault((output.request_id, output.index), []).extend(output.new_token_ids)
        eh.check_pipeline(core)
    assert victim.num_pending == 1 and victim in core.inflight.rows
    fed_after: list[int] = []
    victim.grammar._consume = fed_after.append  # what its grammar would be fed from now on
    [aborted] = core.abort(ids[1])
    assert (aborted.finished, aborted.finish_reason, aborted.new_token_ids) == (True, "abort", [])
    results = eh.run_choices(core, [ids[0], ids[2]])
    assert (ids[1], 0) not in results
    assert victim.status == Status.FINISHED and victim.num_pending == 0
    assert fed_after == [] and not victim.grammar.ahead
    engine = eh.make_core(LLAMA, async_scheduling=False)
    sync_ids = [eh.submit(engine, p, s) for p, s in cases]
    sync = eh.run_choices(engine, sync_ids)
    assert produced[ids[1], 0] == sync[sync_ids[1], 0].token_ids[:len(produced[ids[1], 0])]
    for rid, sync_rid, n in ((ids[0], sync_ids[0], 1), (ids[2], sync_ids[2], 2)):
        for i in range(n):
            assert produced.get((rid, i), []) + results[rid, i].token_ids == sync[sync_rid, i].token_ids
            assert results[rid, i].final.finish_reason == sync[sync_rid, i].final.finish_reason
    _grammars_settled(core, requests)


def test_preempted_constrained_requests_equal_sync_mode():
    """A pool too small for every request preempts constrained ones, some with their token in flight
    (fed ahead to the grammar, then accepted once); recomputed, they go on from the same place."""
    kv = KvCacheConfig(tokens_per_block=16, max_tokens=10 * 16)
    specs = _schemas(4, seed=29)
    cases = [(random_prompt(800 + i, 30 + 6 * i), _params(s, seed=None if i % 2 else 40 + i, max_tokens=60))
             for i, s in enumerate(specs)]
    config = {"kv": kv, "max_num_tokens": 64, "max_batch_size": 4}
    core = eh.make_core(LLAMA, async_scheduling=True, **config)
    ids, requests = _submit(core, cases)
    results, preempted_pending = eh.run_checked(core, ids)
    assert core.scheduler.num_preemptions > 0 and preempted_pending > 0
    assert [_summary(results[i]) for i in ids] == _sync(cases, **config)
    _grammars_settled(core, requests)


def _finals(pair: eh.PairRun, rid: str) -> int:
    return sum(o.finished for o in pair.outputs.get(rid, []))


@pytest.mark.parametrize("seed", [None, 9])
def test_a_generation_leg_with_async_scheduling_equals_the_sync_aggregated_engine(seed):
    """The generation side (async) takes the context server's first token(s), forks n = 2 choices on
    arrival and decodes them with the step in flight's tokens fed ahead: the aggregated sync output."""
    specs = [*_schemas(2, seed=31), GRAMMAR]
    prompts = [random_prompt(900 + i, 10 + 9 * i) for i in range(3)]
    params = [_params(s, seed=None if seed is None else seed + i, n=2, max_tokens=120) for i, s in enumerate(specs)]
    engine = eh.make_core(LLAMA, async_scheduling=False)
    sync_ids = [eh.submit(engine, p, s) for p, s in zip(prompts, params, strict=True)]
    sync = eh.run_choices(engine, sync_ids)
    with eh.loopback_pair(LLAMA, async_scheduling=True) as pair:
        legs = [eh.submit(pair.ctx, p, s, disagg=DisaggParams("context_only"))
                for p, s in zip(prompts, params, strict=True)]
        wait_until(lambda: all(_finals(pair, r) == 2 for r in legs), 60, "the context legs", step=pair.step,
                   interval_s=0.001)
        answers = [next(o for o in pair.outputs[r] if o.index == 0) for r in legs]
        fed, feed = [], pair.gen.structured.feed_ahead
        def spy(step):
            fed.extend(r for r in step.requests if r.grammar is not None and r.status != Status.FINISHED)
            feed(step)
        pair.gen.structured.feed_ahead = spy
        gens = [eh.submit(pair.gen, p, s, disagg=eh.generation_params(a))
                for p, s, a in zip(prompts, params, answers, strict=True)]
        wait_until(lambda: all(_finals(pair, r) == 2 for r in gens), 60, "the generation legs", step=pair.step,
                   interval_s=0.001)
        for gen_id, sync_id in zip(gens, sync_ids, strict=True):
            for i in range(2):
                outputs = [o for o in pair.outputs[gen_id] if o.index == i]
                assert [t for o in outputs for t in o.new_token_ids] == sync[sync_id, i].token_ids
                assert outputs[-1].finish_reason == sync[sync_id, i].final.finish_reason
        assert {r.output_id for r in fed} == set(gens) and {r.choice for r in fed} == {0, 1}
        pair.settle()


def test_speculative_decoding_beside_constrained_requests_equals_sync_mode():
    """ngram drafts for the unconstrained requests (repetitive prompts: drafts accepted and rejected),
    none for the constrained ones, seeded and greedy: verify steps are postprocessed at once, and
    feed_ahead only ever reads a step without drafts, row i being requests[i]."""
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    loop = random_prompt(1000, 6)
    free = [loop * 5, random_prompt(1001, 4) * 6]
    specs = _schemas(3, seed=37)
    cases = [(p, eh.greedy(40)) for p in free]
    cases += [(random_prompt(1010 + i, 9 + 4 * i), _params(s, seed=None if i % 2 else 50 + i, max_tokens=120))
              for i, s in enumerate(specs)]
    cases.append((loop * 3, SamplingParams(max_tokens=40, temperature=0.7, seed=61)))
    core = eh.make_core(LLAMA, async_scheduling=True, speculative=spec)
    fed, feed = [], core.structured.feed_ahead
    def spy(step):
        fed.append(step.drafts)
        feed(step)
    core.structured.feed_ahead = spy
    ids, requests = _submit(core, cases)
    results, _ = eh.run_checked(core, ids)
    assert [_summary(results[i]) for i in ids] == _sync(cases, speculative=spec)
    assert core.spec.stats.proposed > 0 and core.spec.stats.accepted > 0
    assert fed and all(d is None for d in fed)
    _grammars_settled(core, requests)


def test_with_speculative_decoding_a_constrained_step_still_overlaps_the_next_forward():
    """Constrained requests never draft, so a step of only constrained requests is not postprocessed
    before the next schedule for drafts' sake: its tokens are fed ahead once the next forward is
    queued (schedule, forward, then the step before's tokens), as without speculation."""
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    cases = [(random_prompt(1100 + i, 8 + 3 * i), _params(s, seed=None if i % 2 else 70 + i, max_tokens=60))
             for i, s in enumerate(_schemas(4, seed=41))]
    core, events = eh.make_core(LLAMA, async_scheduling=True, speculative=spec), []
    step, schedule, execute, postprocess = core.step, core.scheduler.schedule, core.runner.execute, core._postprocess
    core.step = lambda: (events.append("|"), step())[1]
    core.scheduler.schedule = lambda: (events.append("S"), schedule())[1]
    core.runner.execute = lambda *a, **k: (events.append("F"), execute(*a, **k))[1]
    core._postprocess = lambda s: (events.append("T"), postprocess(s))[1]
    ids, requests = _submit(core, cases)
    results, _ = eh.run_checked(core, ids)
    assert [_summary(results[i]) for i in ids] == _sync(cases, speculative=spec)
    trace = "".join(events)
    assert trace.count("|SFT") >= 10 and "|TSF" not in trace, trace
    assert core.spec.stats.proposed == 0
    _grammars_settled(core, requests)

