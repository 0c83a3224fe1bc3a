"""The py-spy collapsed-stack summary used to explain where a benchmarked server spends its time."""

from __future__ import annotations

from pdserve_bench.profile_stacks import parse_collapsed, self_and_inclusive, totals

SERVE = 'process 7:"python -m server.cli serve"'
ROUTER = 'process 1:"python -m server.cli launch";process 9:"python -m server.cli router"'
RAW = "\n".join([
    f"{SERVE};run (a.py:1);step (core.py:92);forward (llama.py:10) 30",
    f"{SERVE};run (a.py:1);step (core.py:95);schedule (sched.py:4) 10",
    f"{SERVE};main (b.py:3);select (selectors.py:468) 5",
    f"{ROUTER};main (b.py:3);select (selectors.py:468) 5",
    "not a stack line",
])


def test_collapsed_stacks_sum_by_process_and_by_function_without_line_numbers():
    stacks = parse_collapsed(RAW)
    assert [count for _, count in stacks] == [30, 10, 5, 5]
    assert totals(stacks, with_entry=False) == {'process 7:"python -m server.cli serve"': 45,
                                                'process 9:"python -m server.cli router"': 5}
    assert totals(stacks, with_entry=True)['process 7:"python -m server.cli serve" / run (a.py)'] == 40
    own, inclusive = self_and_inclusive(stacks)
    assert own == {"forward (llama.py)": 30, "schedule (sched.py)": 10, "select (selectors.py)": 10}
    assert inclusive["step (core.py)"] == 40  # lines 92 and 95 are one function
    assert inclusive["main (b.py)"] == 10 and inclusive["run (a.py)"] == 40
