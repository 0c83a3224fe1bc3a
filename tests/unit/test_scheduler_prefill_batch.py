"""Exact step plans under `max_prefill_batch_tokens`: which prompts start in a step, in what chunks.

Real KV manager (tpb 4, 64 blocks), no model: the scheduler decides, tests assert the plan
Tokens are marked computed by hand, as the engine's postprocess would.
"""

from __future__ import annotations

import pytest
from kv_factories import make_manager

from server.engine.request import Request
from server.engine.scheduler import Scheduler, SchedulerConfig
from server.types import DisaggParams, SamplingParams


def scheduler(max_prefill_batch_tokens: int | None, max_num_tokens: int = 64) -> Scheduler:
    kv = make_manager("cpu", primary_blocks=64, max_seq_len=256, windows=(256,))
    return Scheduler(SchedulerConfig(max_num_tokens, 16, 256, max_prefill_batch_tokens), kv)


def request(name: str, prompt_len: int, disagg: DisaggParams | None = None) -> Request:
    prompt = [1000 * len(name) + ord(name[0]) * 10 + i for i in range(prompt_len)]  # no shared prefix
    return Request(name, prompt, SamplingParams(max_tokens=4), frozenset({2}), disagg=disagg)


def step(s: Scheduler) -> list[tuple[str, int]]:
    """One schedule; computed counts advance as after a run (a finished prefill samples one token)."""
    plan = s.schedule()
    for chunk in plan.chunks:
        sampled = chunk.need_logits  # before the computed count moves
        chunk.request.num_computed_tokens += chunk.num_new_tokens
        if sampled:
            chunk.request.append_token(7)
    return [(c.request.request_id, c.num_new_tokens) for c in plan.chunks]


def test_without_a_limit_one_step_takes_every_prompt_that_fits():
    s = scheduler(None)
    for name, n in (("a", 20), ("b", 20), ("c", 20)):
        s.add(request(name, n))
    assert step(s) == [("a", 20), ("b", 20), ("c", 20)]


def test_a_step_starts_no_more_prompts_once_its_prefill_reaches_the_limit():
    s = scheduler(16)
    for name, n in (("a", 10), ("b", 10), ("c", 10)):
        s.add(request(name, n))
    assert step(s) == [("a", 10), ("b", 10)]  # 10 < 16: b still starts; 20 >= 16: c waits
    assert [r.request_id for r in s.waiting] == ["c"]
    assert step(s) == [("a", 1), ("b", 1), ("c", 10)]  # decode tokens do not count


def test_a_started_long_prompt_goes_on_in_chunks_and_holds_back_the_next():
    s = scheduler(8, max_num_tokens=32)
    s.add(request("long", 70))
    s.add(request("short", 5))
    assert step(s) == [("long", 32)]
    assert step(s) == [("long", 32)]
    assert step(s) == [("long", 6), ("short", 5)]  # 6 < 8: the next prompt may start
    assert step(s) == [("long", 1), ("short", 1)]


def test_generation_only_admissions_are_not_held_back_by_prefill():
    s = scheduler(4)
    params = DisaggParams(request_type="generation_only", ctx_request_id="c1", ctx_endpoint="tcp://x:1",
                          ctx_epoch="e", first_gen_tokens=(7,))
    s.add(request("prefill", 12))
    s.add(request("pull", 12, params))
    plan = s.schedule()
    assert [(c.request.request_id, c.num_new_tokens) for c in plan.chunks] == [("prefill", 12)]
    assert [r.request_id for r in plan.to_pull] == ["pull"]


@pytest.mark.parametrize("limit", [1, 3])
def test_the_first_prompt_always_starts(limit):
    s = scheduler(limit)
    s.add(request("a", 9))
    assert step(s) == [("a", 9)]
