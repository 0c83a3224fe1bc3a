"""`pdserve-bench load`: how a run is split over client processes, the figures of a run (exact values
on hand-made timelines: classes apart, first window, time series, the servers' own means), and the
multi-process client itself against the real HTTP API (the unit tests' fake engine) on loopback."""

from __future__ import annotations

import argparse
import math

import msgspec
import pytest
from test_api_engine_fake import FakeEngine
from waiting import uvicorn_in_thread

from pdserve_bench.load import figure_name, load_plan, scrape_list
from pdserve_bench.load_client import READY_TIMEOUT_S, LoadPlan, plan_jobs, run_load
from pdserve_bench.load_figures import (
    load_summary,
    parse_metrics,
    server_means,
    steady_tok_s,
    time_series,
    window_figures,
)
from pdserve_bench.load_job import Traffic, WorkerJob, prompt_for
from pdserve_bench.stats import SLO, RequestResult, percentile
from server.api.app import create_app


def _request(start: float, ttft: float, tpot: float, tokens: int = 5) -> RequestResult:
    """Tokens one per chunk: the first at start + ttft, then every tpot."""
    chunks = [start + ttft + i * tpot for i in range(tokens)]
    return RequestResult(start=start, end=chunks[-1], first_token=chunks[0], output_tokens=tokens,
                         prompt_tokens=10, chunk_times=chunks)


# ---- the plan ------------------------------------------------------------------------------------

def test_streams_and_arrivals_are_dealt_round_robin_over_the_processes():
    main = Traffic("background", 8, 4, concurrency=5, count=12, seed=1)
    long = Traffic("long", 64, 2, rate=2.0, count=5, seed=2)
    jobs = plan_jobs(LoadPlan((main, long), duration_s=None, ramp_s=1.0), "http://x", "m", [5, 6, 7], procs=2)
    assert [[s.index for s in job.streams] for job in jobs] == [[0, 2, 4], [1, 3]]
    assert [s.start for s in jobs[0].streams] == [0.0, 0.4, 0.8]
    # 12 requests over 5 streams: 3, 3, 2, 2, 2
    assert [s.count for job in jobs for s in job.streams] == [3, 2, 2, 3, 2]
    assert [[a.index for a in job.arrivals] for job in jobs] == [[0, 2, 4], [1, 3]]
    assert all(a.at >= 0 and a.traffic == "long" for job in jobs for a in job.arrivals)
    assert jobs[0].vocab == [5, 6, 7] and jobs[0].traffic == [main, long]
    wire = msgspec.json.encode(jobs[1])  # what goes down the worker's stdin
    assert msgspec.json.decode(wire, type=WorkerJob) == jobs[1]


def test_no_more_processes_than_there_is_work_for():
    closed = LoadPlan((Traffic("main", 8, 4, concurrency=3, count=6),))
    assert len(plan_jobs(closed, "u", "m", [5], procs=8)) == 3
    opened = LoadPlan((Traffic("main", 8, 4, rate=1.0, count=2),))
    jobs = plan_jobs(opened, "u", "m", [5], procs=8)
    assert [len(j.arrivals) for j in jobs] == [1, 1] and all(not j.streams for j in jobs)


def test_a_plan_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="exactly one"):
        LoadPlan((Traffic("main", 8, 4, concurrency=2, rate=1.0, count=3),))
    with pytest.raises(ValueError, match="request count or a duration"):
        LoadPlan((Traffic("main", 8, 4, concurrency=2),))
    with pytest.raises(ValueError, match="names must differ"):
        LoadPlan((Traffic("a", 8, 4, concurrency=1), Traffic("a", 8, 4, rate=1.0)), duration_s=1.0)
    with pytest.raises(ValueError, match="at least one"):
        LoadPlan(())


def test_the_time_limit_covers_the_ramp_the_duration_and_the_requests_of_a_stream():
    timed = LoadPlan((Traffic("main", 8, 4, concurrency=2),), duration_s=30.0, ramp_s=5.0, request_timeout_s=100.0)
    assert timed.time_limit_s() == READY_TIMEOUT_S + 5.0 + 30.0 + 100.0
    counted = LoadPlan((Traffic("main", 8, 4, concurrency=2, count=7),), request_timeout_s=100.0)
    assert counted.time_limit_s() == READY_TIMEOUT_S + 4 * 100.0  # 4 requests one after another per stream


def test_prompts_depend_only_on_the_traffic_seed_and_the_request_key():
    t = Traffic("main", 16, 4, concurrency=1, seed=9)
    vocab = list(range(100, 140))
    first = prompt_for(t, "s0/0", vocab)
    assert first == prompt_for(t, "s0/0", vocab) and len(first) == 16 and set(first) <= set(vocab)
    assert first != prompt_for(t, "s0/1", vocab) and first != prompt_for(t, "s1/0", vocab)
    assert first != prompt_for(Traffic("main", 16, 4, concurrency=1, seed=10), "s0/0", vocab)


def _args(**kw) -> argparse.Namespace:
    base = dict(seed=0, workload="random", input_len=32, output_len=8, concurrency=4, rate=None, num_requests=None,
                duration=10.0, ramp_s=2.0, long_input_len=256, long_output_len=4, long_rate=0.5, long_requests=None)
    return argparse.Namespace(**(base | kw))


def test_the_subcommand_plans_fresh_seeds_per_repeat_and_names_its_figures():
    plan = load_plan(_args(), 0)
    assert plan.traffic == (Traffic("main", 32, 8, concurrency=4, seed=0),) and plan.ramp_s == 2.0
    assert load_plan(_args(), 1).traffic[0].seed == 1
    assert figure_name(plan) == "c=4"
    assert figure_name(load_plan(_args(concurrency=None, rate=3.0), 0)) == "rate=3/s"
    mixed = load_plan(_args(workload="mixed"), 0)
    assert [t.name for t in mixed.traffic] == ["background", "long"] and mixed.traffic[1].rate == 0.5
    assert figure_name(mixed) == "c=4 + 256in@0.5/s"
    with pytest.raises(SystemExit, match="request count or a duration"):
        load_plan(_args(duration=None), 0)


def test_scrape_urls_name_their_role():
    assert scrape_list(["http://a:1/", "generation=http://b:2"]) == (("server", "http://a:1"),
                                                                     ("generation", "http://b:2"))
    with pytest.raises(SystemExit, match="--scrape"):
        scrape_list(["context=http://a:1"])
    with pytest.raises(SystemExit, match="--scrape"):
        scrape_list(["a:1"])


# ---- the figures ----------------------------------------------------------------------------------

def test_the_mixed_workload_reports_each_class_apart():
    background = [_request(0.0, 0.5, 0.125, tokens=9), _request(1.0, 0.25, 0.25, tokens=9)]
    long = [_request(2.0, 1.0, 0.5, tokens=3)]
    out = load_summary({"background": background, "long": long}, SLO(ttft_s=2.0, tpot_s=0.25))
    assert out["requests"] == 3.0 and out["tpot_p50_ms"] == 250.0  # all of them: 125, 250, 500 ms
    assert out["chunks_per_token"] == 1.0
    assert out["background_requests"] == 2.0 and out["long_requests"] == 1.0
    assert out["background_tpot_p99_ms"] == pytest.approx(percentile([0.125, 0.25], 99) * 1e3)
    assert out["background_itl_p99_ms"] == 250.0 and out["long_ttft_p50_ms"] == 1000.0
    assert out["long_tpot_p99_ms"] == 500.0 and out["long_slo_attainment"] == 0.0
    assert out["background_slo_attainment"] == 1.0
    single = load_summary({"main": background}, SLO())
    assert "main_tpot_p99_ms" not in single  # one class: the run's figures are its figures


def test_the_first_window_is_set_against_the_rest_of_the_run():
    t0 = 100.0
    results = [_request(100.5, 0.25, 0.1), _request(101.0, 0.75, 0.1), _request(103.0, 0.125, 0.1),
               _request(104.0, 0.125, 0.1), RequestResult(start=100.2, end=100.3, error="HTTP 500")]
    out = window_figures(results, t0, window_s=2.0)
    assert out["ttft_mean_first_window_ms"] == 500.0 and out["ttft_mean_later_ms"] == 125.0
    assert out["first_vs_later_ttft"] == 4.0 and out["first_window_requests"] == 2.0
    assert math.isnan(window_figures(results, t0, window_s=60.0)["ttft_mean_later_ms"])


def test_the_time_series_counts_per_bin():
    t0 = 10.0
    a = _request(10.25, 0.25, 0.25, tokens=4)  # chunks at 10.5, 10.75, 11.0, 11.25
    b = _request(11.5, 1.0, 0.25, tokens=2)  # chunks at 12.5, 12.75
    failed = RequestResult(start=12.0, end=12.1, error="HTTP 503")
    out = time_series([a, b, failed], t0, bin_s=1.0)
    assert out["t_s"] == [0.0, 1.0, 2.0]
    assert out["started"] == [1.0, 1.0, 1.0] and out["errors"] == [0.0, 0.0, 1.0]
    assert out["ttft_mean_ms"][:2] == [250.0, 1000.0] and math.isnan(out["ttft_mean_ms"][2])
    assert out["output_tok_s"] == [2.0, 2.0, 2.0]
    assert steady_tok_s([a, b], 10.6, 12.6) == pytest.approx(4 / 2.0)  # 10.75, 11.0, 11.25 and 12.5
    assert math.isnan(steady_tok_s([a, b], 11.0, math.nan))


METRICS_BEFORE = """# HELP pdserve_time_to_first_token_seconds Arrival to first token.
pdserve_time_to_first_token_seconds_bucket{le="0.1"} 3.0
pdserve_time_to_first_token_seconds_count 4.0
pdserve_time_to_first_token_seconds_sum 0.5
pdserve_request_queue_time_seconds_count 4.0
pdserve_request_queue_time_seconds_sum 0.25
"""
METRICS_AFTER = METRICS_BEFORE.replace("count 4.0", "count 8.0").replace("first_token_seconds_sum 0.5",
                                                                          "first_token_seconds_sum 1.5")


def test_the_servers_means_come_from_their_histograms_between_two_scrapes():
    before, after = parse_metrics(METRICS_BEFORE), parse_metrics(METRICS_AFTER)
    assert before["pdserve_time_to_first_token_seconds_sum"] == 0.5
    assert before["pdserve_time_to_first_token_seconds_count"] == 4.0
    out = server_means(before, after)
    assert out["server_ttft_mean_ms"] == 250.0  # (1.5 - 0.5) s over 4 requests
    assert out["server_queue_mean_ms"] == 0.0  # four more requests, no more queue time
    assert math.isnan(out["server_tpot_mean_ms"])  # no such histogram: nothing finished


# ---- the client processes against a real HTTP API --------------------------------------------------

@pytest.fixture(scope="module")
def bench_engine() -> FakeEngine:
    return FakeEngine(model_name="fake-model", max_seq_len=256)


@pytest.fixture(scope="module")
def base_url(bench_engine):
    with uvicorn_in_thread(create_app(lambda: bench_engine), 20.0) as url:
        yield url


def test_worker_processes_run_a_closed_loop_and_an_open_loop_together(base_url):
    plan = LoadPlan((Traffic("background", 12, 5, concurrency=3, count=6, seed=1),
                     Traffic("long", 40, 3, rate=50.0, count=4, seed=2)), ramp_s=0.2)
    found = run_load(plan, base_url, "fake-model", list(range(97, 123)), procs=2)
    assert found.workers == 2
    background, long = found.by_traffic["background"], found.by_traffic["long"]
    assert len(background) == 6 and len(long) == 4
    assert all(r.error is None for r in background + long), [r.error for r in background + long]
    assert {r.output_tokens for r in background} == {5} and {r.prompt_tokens for r in background} == {12}
    assert {r.output_tokens for r in long} == {3} and {r.prompt_tokens for r in long} == {40}
    for r in background + long:
        assert found.t0 <= r.start < r.first_token <= r.chunk_times[-1] <= r.end
        assert len(r.chunk_times) == r.output_tokens  # the fake streams one character per token
    assert len(found.all) == 10 and [r.start for r in found.all] == sorted(r.start for r in found.all)
    assert len(found.done) == 2 and all(d.cpu_s > 0 and d.wall_s > 0 for d in found.done)
    assert 0 < found.busiest_worker == max(d.cpu_s / d.wall_s for d in found.done)


def test_server_errors_come_back_as_failed_requests(base_url):
    plan = LoadPlan((Traffic("main", 4, 2, concurrency=1, count=2),))
    found = run_load(plan, base_url, "fake-model", [300], procs=1)  # outside the fake's vocabulary
    assert [r.error[:9] for r in found.by_traffic["main"]] == ["HTTP 400:", "HTTP 400:"]


def test_a_worker_that_finishes_early_does_not_end_the_run(base_url):
    # seed 1 at 4/s: arrivals at 0.04 s and 0.51 s, one per worker; the first worker sends Done and
    # exits while the second one still waits for its arrival
    plan = LoadPlan((Traffic("main", 4, 2, rate=4.0, count=2, seed=1),))
    found = run_load(plan, base_url, "fake-model", list(range(97, 123)), procs=2)
    assert len(found.done) == 2 and [r.error for r in found.by_traffic["main"]] == [None, None]
    assert [round(r.start - found.t0, 1) for r in found.all] == [0.0, 0.5]


def test_a_traffic_class_sends_its_body_fields_with_every_request(base_url, bench_engine):
    """`Traffic.body` (what a feature costs: logprobs, penalties, a response_format) reaches the server
    in every request of the class, and the others' bodies stay plain."""
    plan = LoadPlan((Traffic("scored", 6, 3, concurrency=1, count=2, seed=3,
                             body={"logprobs": 2, "frequency_penalty": 0.5}),
                     Traffic("plain", 6, 3, concurrency=1, count=2, seed=4)))
    found = run_load(plan, base_url, "fake-model", list(range(97, 123)), procs=2)
    assert all(r.error is None for r in found.all), [r.error for r in found.all]
    sampling = [r.sampling for r in bench_engine.requests[-4:]]
    assert sorted((s.logprobs or 0, s.frequency_penalty) for s in sampling) == [(0, 0.0)] * 2 + [(2, 0.5)] * 2
