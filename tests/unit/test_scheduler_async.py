"""Exact step plans with async scheduling: a step is planned while the one before is in flight, so
requests hold a pending token (sampled, id still on the device).

Real KV manager (tpb 4), no model: tokens are marked computed and sampled by hand as the engine
does (`launch`: counts move and sampled requests get a pending token; `arrive`: the ids reach the
host one step later), and tests assert the plans and the KV state.
"""

from __future__ import annotations

from kv_factories import make_manager

from server.engine.request import Request, Status
from server.engine.scheduler import Scheduler, SchedulerConfig, committable
from server.types import DisaggParams, SamplingParams


def scheduler(primary_blocks: int, max_seq_len: int = 64) -> Scheduler:
    kv = make_manager("cpu", primary_blocks=primary_blocks, max_seq_len=max_seq_len, windows=(max_seq_len,))
    return Scheduler(SchedulerConfig(64, 16, max_seq_len), kv)


def request(name: str, prompt_len: int, max_tokens: int = 8, disagg: DisaggParams | None = None) -> Request:
    prompt = [100 * ord(name[0]) + i for i in range(prompt_len)]  # no shared prefix
    return Request(name, prompt, SamplingParams(max_tokens=max_tokens), frozenset({2}), disagg=disagg)


def launch(s: Scheduler) -> tuple[list[tuple[str, int]], list[Request]]:
    """One schedule and launch: (the plan, the requests it sampled, now pending)."""
    plan = s.schedule()
    sampled = [c.request for c in plan.chunks if c.need_logits]  # before the computed counts move
    for chunk in plan.chunks:
        chunk.request.num_computed_tokens += chunk.num_new_tokens
        s.kv.commit(chunk.request.request_id, chunk.request.all_token_ids, committable(chunk.request))
    for r in sampled:
        r.num_pending += 1
    return [(c.request.request_id, c.num_new_tokens) for c in plan.chunks], sampled


def arrive(sampled: list[Request], token: int = 7) -> None:
    """The launched step's ids reach the host."""
    for r in sampled:
        r.num_pending -= 1
        r.append_token(token)


def test_a_pending_token_is_the_input_of_the_next_row():
    s = scheduler(16)
    a, b = request("a", 6), request("b", 3)
    s.add(a)
    s.add(b)
    plan, first = launch(s)
    assert plan == [("a", 6), ("b", 3)] and first == [a, b]
    assert (a.num_tokens, a.num_known_tokens, a.num_computed_tokens) == (7, 6, 6)
    plan, second = launch(s)  # the first step is still in flight: its tokens are the inputs
    assert plan == [("a", 1), ("b", 1)] and second == [a, b]
    assert (a.num_pending, a.num_computed_tokens, a.num_known_tokens) == (2, 7, 6)
    arrive(first)
    assert (a.num_tokens, a.num_known_tokens, a.num_computed_tokens) == (8, 7, 7)
    assert [len(s.kv.block_ids(r.request_id, 64)) for r in (a, b)] == [2, 1]  # room for 7 and 4 tokens


def test_a_request_whose_pending_token_ends_it_gets_no_row():
    s = scheduler(16, max_seq_len=12)
    one = request("o", 4, max_tokens=1)
    ctx = request("c", 4, disagg=DisaggParams("context_only"))
    full = request("f", 11)  # its first token is the 12th: max_seq_len
    more = request("m", 4, max_tokens=2)
    for r in (one, ctx, full, more):
        s.add(r)
    assert launch(s)[0] == [("o", 4), ("c", 4), ("f", 11), ("m", 4)]
    plan, sampled = launch(s)
    assert plan == [("m", 1)] and sampled == [more]  # its second token may still be produced
    assert [r.num_computed_tokens for r in (one, ctx, full)] == [4, 4, 11]
    assert launch(s)[0] == []  # m's pending token is its second and last


def test_preemption_passes_over_requests_ending_with_their_pending_token():
    """A request whose pending token ends it frees its blocks at the next step anyway (and a context
    leg must still offer its blocks): the newest other request is preempted."""
    s = scheduler(6)
    a, b, c = request("a", 8), request("b", 7), request("c", 8, max_tokens=1)
    for r in (a, b, c):
        s.add(r)
    plan, first = launch(s)
    assert plan == [("a", 8), ("b", 7), ("c", 8)] and s.kv.num_available_blocks() == 0
    plan, _ = launch(s)  # a's token 9 needs a third block: b goes, c (newest) stays
    assert plan == [("a", 1)] and s.num_preemptions == 1
    assert s.running == [a, c] and list(s.waiting) == [b]
    assert (b.status, b.num_computed_tokens, b.num_pending) == (Status.WAITING, 0, 1)
    assert b.request_id not in s.kv.request_ids()
    arrive(first)  # b's token arrives while it waits: it is recomputed with it
    assert b.all_token_ids == b.prompt_token_ids + [7] and b.num_pending == 0


def test_a_request_preempted_with_its_token_pending_waits_for_it():
    """Re-admitted, a request is recomputed from its ids, so not before its pending token arrived;
    it keeps the head of the queue meanwhile (first come, first served)."""
    s = scheduler(16)
    early, late = request("e", 5), request("l", 6)
    early.num_pending = 1  # as after a preemption in this step: its token is on the device
    s.add(early)
    s.add(late)
    assert launch(s)[0] == []
    assert list(s.waiting) == [early, late] and not list(s.kv.request_ids())
    arrive([early])
    plan, sampled = launch(s)
    assert plan == [("e", 6), ("l", 6)] and sampled == [early, late]


def test_commits_cover_known_ids_only():
    s = scheduler(16)
    a = request("a", 7)
    s.add(a)
    _, first = launch(s)  # 7 computed; the pending 8th completes block 1
    launch(s)  # computes the 8th: its id is still on the device
    assert (a.num_computed_tokens, committable(a)) == (8, 7)
    probe = a.prompt_token_ids + [7, 1]
    assert s.kv.admit("probe-1", probe) == 4  # block 1 is not in the reuse tree yet
    s.kv.release("probe-1")
    arrive(first)
    s.kv.commit("a", a.all_token_ids, committable(a))  # the engine's postprocess does this
    assert committable(a) == 8 and s.kv.admit("probe-2", probe) == 8
