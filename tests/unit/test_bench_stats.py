"""The serving benchmark's statistics, workloads and goal verdicts on synthetic timelines."""

from __future__ import annotations

import math
import os

import pytest

from pdserve_bench.cpu import cpu_times, ppid_and_cpu_ticks, tree_cpu_s, tree_cpu_ticks
from pdserve_bench.goals import _best, _paired_median
from pdserve_bench.stats import RequestResult, median_summary, percentile, ratio, summarize
from pdserve_bench.tables import Comparison, comparisons_table, figures_table
from pdserve_bench.workloads import (
    SharedPrefixShape,
    random_workload,
    shared_prefix_workload,
    usable_token_ids,
)


def test_percentile_interpolates_linearly_between_ranks():
    values = [4.0, 1.0, 3.0, 2.0]  # unsorted on purpose
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 90) == pytest.approx(3.7)  # rank 2.7: 3 + 0.7 * (4 - 3)
    assert percentile(values, 99) == pytest.approx(3.97)
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError, match="outside"):
        percentile(values, 101)


def test_request_timeline_gives_ttft_tpot_e2e_and_itls():
    r = RequestResult(start=10.0, end=10.3, first_token=10.1, output_tokens=5,
                      chunk_times=[10.1, 10.12, 10.15, 10.2, 10.3])
    assert r.ttft == pytest.approx(0.1)
    assert r.e2e == pytest.approx(0.3)
    assert r.tpot == pytest.approx(0.2 / 4)  # (e2e - ttft) / (output_tokens - 1)
    assert r.itls == pytest.approx([0.02, 0.03, 0.05, 0.1])
    one = RequestResult(start=0.0, end=1.0, first_token=0.5, output_tokens=1, chunk_times=[0.5])
    assert one.tpot is None and one.itls == []
    failed = RequestResult(start=0.0, end=1.0, error="HTTP 500")
    assert failed.ttft is None and failed.tpot is None and not failed.ok


def _timeline() -> list[RequestResult]:
    """Two good requests and one failure on a 2-second window."""
    return [
        RequestResult(start=0.0, end=1.0, first_token=0.2, output_tokens=5, prompt_tokens=100,
                      cached_tokens=64, chunk_times=[0.2, 0.4, 0.6, 0.8, 1.0]),
        RequestResult(start=0.5, end=2.0, first_token=0.9, output_tokens=12, prompt_tokens=100,
                      cached_tokens=0, chunk_times=[0.9, 2.0]),
        RequestResult(start=1.0, end=1.5, error="HTTP 503: overloaded"),
    ]


def test_summarize_counts_only_successful_requests_over_the_whole_window():
    s = summarize(_timeline())
    assert s["requests"] == 3 and s["errors"] == 1
    assert s["duration_s"] == pytest.approx(2.0)  # last end - first start, failures included
    assert s["output_tokens"] == 17
    assert s["output_tok_s"] == pytest.approx(17 / 2.0)
    assert s["req_s"] == pytest.approx(1.0)
    assert s["cache_hit_rate"] == pytest.approx(64 / 200)
    assert s["ttft_mean_ms"] == pytest.approx(300.0)  # (0.2 + 0.4) / 2
    assert s["ttft_p50_ms"] == pytest.approx(300.0)
    assert s["ttft_p99_ms"] == pytest.approx(200.0 + 200.0 * 0.99)
    # TPOTs: (1.0 - 0.2) / 4 = 0.2 and (1.5 - 0.4) / 11 = 0.1
    assert s["tpot_mean_ms"] == pytest.approx(150.0)
    assert s["tpot_p90_ms"] == pytest.approx(100.0 + 100.0 * 0.9)
    assert s["itl_p50_ms"] == pytest.approx(200.0)  # gaps 0.2 x4 and 1.1
    assert s["e2e_mean_ms"] == pytest.approx(1250.0)


def test_summarize_with_only_failures_reports_nan_latencies():
    s = summarize([RequestResult(start=0.0, end=1.0, error="boom")])
    assert s["errors"] == 1 and s["output_tokens"] == 0 and s["output_tok_s"] == 0.0
    assert math.isnan(s["ttft_mean_ms"]) and math.isnan(s["tpot_p99_ms"])


def test_median_summary_takes_per_key_medians_ignoring_nan():
    runs = [{"a": 1.0, "b": math.nan}, {"a": 5.0, "b": 2.0}, {"a": 3.0, "b": 4.0}]
    assert median_summary(runs) == {"a": 3.0, "b": 3.0, "runs": 3.0}
    assert median_summary([{"a": 2.0}, {"a": 4.0}])["a"] == 3.0  # even count: mean of the middle two
    with pytest.raises(ValueError):
        median_summary([])


def test_comparison_verdicts_and_ratio_edge_cases():
    assert Comparison("tok/s", 400.0, 100.0, 4.0).verdict == "met"
    assert Comparison("tok/s", 399.0, 100.0, 4.0).verdict == "MISSED"
    assert Comparison("ttft", 13.0, 10.0, 1.3, at_least=False).verdict == "met"
    assert Comparison("ttft", 14.0, 10.0, 1.3, at_least=False).verdict == "MISSED"
    assert Comparison("x", 1.0, 0.0, 1.0).verdict == "n/a"
    assert math.isnan(ratio(math.nan, 1.0))
    table = comparisons_table([Comparison("tok/s", 400.0, 100.0, 4.0)])
    assert table.splitlines()[-1] == "| tok/s | 400.00 | 100.00 | 4.00x | - | - | >= 4x | met |"
    row = figures_table([("fig", summarize(_timeline()))]).splitlines()[-1]
    assert row.startswith("| fig | 3 | 1 | 8.5 | 300.0 | 300.0 |")


class _Tok:
    """The two things `usable_token_ids` reads from a tokenizer."""

    all_special_ids = [0, 3]

    def __len__(self) -> int:
        return 6


def test_random_workload_is_seeded_exact_length_and_avoids_special_ids():
    vocab = usable_token_ids(_Tok())
    assert vocab == [1, 2, 4, 5]
    a = random_workload(vocab, num_prompts=3, input_len=50, output_len=7, seed=1)
    assert a == random_workload(vocab, num_prompts=3, input_len=50, output_len=7, seed=1)
    assert a != random_workload(vocab, num_prompts=3, input_len=50, output_len=7, seed=2)
    assert [len(p) for p in a.prompts] == [50, 50, 50] and a.max_tokens == 7
    assert {t for p in a.prompts for t in p} <= set(vocab)
    assert a.input_tokens == 150


def test_shared_prefix_workload_groups_share_exactly_their_prefix():
    shape = SharedPrefixShape(groups=3, prompts_per_group=4, prefix_len=20, question_len=5, output_len=2)
    vocab = list(range(10, 1000))
    w = shared_prefix_workload(vocab, shape, seed=7)
    assert w == shared_prefix_workload(vocab, shape, seed=7)
    assert len(w.prompts) == 12 and {len(p) for p in w.prompts} == {25} and w.max_tokens == 2
    groups: dict[tuple[int, ...], list[list[int]]] = {}
    for prompt in w.prompts:
        groups.setdefault(tuple(prompt[:20]), []).append(prompt)
    assert sorted(len(g) for g in groups.values()) == [4, 4, 4]
    assert len({tuple(p[20:]) for p in w.prompts}) == 12  # distinct questions
    order = [list(groups).index(tuple(p[:20])) for p in w.prompts]
    assert order != sorted(order)  # shuffled, not group after group


def test_cpu_times_reads_the_aggregate_line_of_proc_stat():
    stat = "cpu  100 5 50 800 20 3 2 0 0 0\ncpu0 50 2 25 400 10 1 1 0 0 0\nintr 1 2 3\n"
    assert cpu_times(stat) == (160, 980)  # busy = total - idle - iowait; total of the first 8 fields
    with pytest.raises(ValueError, match="no aggregate"):
        cpu_times("cpu0 1 2 3 4\n")


def test_paired_median_ratio_is_robust_to_a_slow_repeat():
    # repeat 2 ran while the machine was busy: both figures slowed down 5x together
    assert _paired_median([100.0, 20.0, 110.0], [50.0, 10.0, 50.0]) == pytest.approx(2.0)
    assert math.isnan(_paired_median([1.0], [0.0]))


def test_best_run_is_the_fastest_rate_or_the_lowest_latency():
    assert _best([100.0, math.nan, 300.0, 200.0], "output_tok_s") == 300.0
    assert _best([100.0, math.nan, 300.0, 200.0], "ttft_mean_ms") == 100.0
    assert _best([3.0, 1.0, 2.0], "server_cpu_ms_per_token") == 1.0  # less CPU per token is better
    assert math.isnan(_best([math.nan], "ttft_mean_ms"))


def test_process_tree_cpu_time_sums_a_process_and_its_descendants():
    line = "4242 (python -m x) S 4200 4242 4242 0 -1 4194304 10 0 0 0 150 25 0 0 20 0 3 0 1000 0 0"
    assert ppid_and_cpu_ticks(line) == (4200, 175)  # fields 4 (ppid), 14 (utime), 15 (stime)
    table = {10: (1, 5), 11: (10, 7), 12: (11, 100), 13: (10, 1), 20: (1, 1000)}  # pid: (ppid, ticks)
    assert tree_cpu_ticks(table, 10) == 113  # 10, its children 11 and 13, grandchild 12; not 20
    assert tree_cpu_ticks(table, 99) == 0
    assert tree_cpu_s(os.getpid()) > 0.0  # this test process has used CPU
