"""Workload generators: chat replay turns extend the last prompt, shared prefixes, the scaled length grid."""

from __future__ import annotations

from fractions import Fraction

import pytest

from pdserve_bench.measure import WorkloadArgs, figures_for
from pdserve_bench.workloads import (
    MultiTurnShape,
    SharedPrefixShape,
    length_grid,
    multi_turn_workload,
    parse_scale,
    random_workload,
    shared_prefix_workload,
)

VOCAB = list(range(10, 5000))


def test_every_chat_turn_is_the_previous_prompt_plus_an_answer_plus_a_user_message():
    shape = MultiTurnShape(conversations=3, turns=4, user_len=20, output_len=6)
    w = multi_turn_workload(VOCAB, shape, seed=5)
    assert w == multi_turn_workload(VOCAB, shape, seed=5)
    assert w != multi_turn_workload(VOCAB, shape, seed=6)
    assert w.max_tokens == 6 and len(w.prompts) == 12
    assert w.sessions == ((0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11))
    assert w.session_list() == list(w.sessions)
    for session in w.sessions:
        turns = [w.prompts[i] for i in session]
        assert [len(t) for t in turns] == [20, 46, 72, 98]  # + 6 answer + 20 user tokens per turn
        for previous, current in zip(turns, turns[1:], strict=False):
            assert current[: len(previous)] == previous  # the whole previous prompt is the prefix
    firsts = [w.prompts[s[0]] for s in w.sessions]
    assert len({tuple(p) for p in firsts}) == 3  # conversations differ from their first turn
    assert {t for p in w.prompts for t in p} <= set(VOCAB)


def test_single_prompt_workloads_have_one_session_per_prompt():
    w = random_workload(VOCAB, num_prompts=3, input_len=4, output_len=2, seed=1)
    assert w.sessions is None and w.session_list() == [(0,), (1,), (2,)]


def test_shared_prefix_prompts_share_the_prefix_of_their_group_only():
    shape = SharedPrefixShape(groups=2, prompts_per_group=3, prefix_len=16, question_len=4, output_len=2)
    w = shared_prefix_workload(VOCAB, shape, seed=3)
    prefixes = {tuple(p[:16]) for p in w.prompts}
    assert len(prefixes) == 2
    for prefix in prefixes:
        assert sum(tuple(p[:16]) == prefix for p in w.prompts) == 3


def test_the_length_grid_scales_both_lengths_and_keeps_the_full_sizes_at_scale_one():
    full = [(p.label, p.input_len, p.output_len) for p in length_grid()]
    assert full == [("1k/1k", 1024, 1024), ("8k/1k", 8192, 1024), ("1k/8k", 1024, 8192), ("8k/256", 8192, 256)]
    cpu = [(p.label, p.input_len, p.output_len) for p in length_grid(Fraction(1, 16))]
    assert cpu == [("1k/1k", 64, 64), ("8k/1k", 512, 64), ("1k/8k", 64, 512), ("8k/256", 512, 16)]
    tiny = length_grid(Fraction(1, 10000))
    assert [(p.input_len, p.output_len) for p in tiny] == [(1, 1)] * 4  # never below one token


def test_scale_parses_fractions_and_decimals_and_refuses_the_rest():
    assert parse_scale("1/16") == Fraction(1, 16)
    assert parse_scale("0.25") == Fraction(1, 4)
    assert parse_scale("1") == 1
    for bad in ("0", "2", "-1/4", "x", "1/0"):
        with pytest.raises(ValueError, match="--scale"):
            parse_scale(bad)


def test_grid_figures_draw_scaled_prompts_with_their_own_seeds():
    args = WorkloadArgs(num_prompts_c1=2, num_prompts_per_slot=2, scale=Fraction(1, 16))
    figures = figures_for("grid", VOCAB, args, 4)
    assert [f.name for f in figures] == ["grid 1k/1k c=4", "grid 8k/1k c=4", "grid 1k/8k c=4", "grid 8k/256 c=4"]
    assert len({f.seed_base for f in figures}) == 4
    w = figures[1].workload(0)
    assert len(w.prompts) == 8 and {len(p) for p in w.prompts} == {512} and w.max_tokens == 64
    assert figures[1].shape == {"grid_point": "8k/1k", "scale": "1/16", "num_prompts": 8, "input_len": 512,
                                "output_len": 64}
    assert figures[1].workload(0) != figures[1].workload(1)  # fresh prompts every repeat
    chat = figures_for("multi-turn", VOCAB, args, 2)[0]
    assert chat.name == "multi-turn c=2" and chat.workload(0).sessions is not None
    with pytest.raises(ValueError, match="unknown workload"):
        figures_for("nope", VOCAB, args, 1)
