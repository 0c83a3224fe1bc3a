"""Percentiles and goodput within an SLO, exact values on hand-made request timelines."""

from __future__ import annotations

import math

import pytest

from pdserve_bench.stats import SLO, RequestResult, goodput, summarize


def _request(start: float, ttft: float, tpot: float, tokens: int = 5) -> RequestResult:
    """A request whose tokens arrive one per chunk: first at start + ttft, then every tpot."""
    chunks = [start + ttft + i * tpot for i in range(tokens)]
    return RequestResult(start=start, end=chunks[-1], first_token=chunks[0], output_tokens=tokens,
                         prompt_tokens=10, chunk_times=chunks)


def test_slo_boundaries_are_inclusive_and_failures_never_meet_it():
    slo = SLO(ttft_s=1.0, tpot_s=0.25)  # binary fractions: exact in floating point
    assert slo.met_by(_request(0.0, 1.0, 0.25))  # both exactly at the target
    assert not slo.met_by(_request(0.0, 1.125, 0.125))  # TTFT over
    assert not slo.met_by(_request(0.0, 0.5, 0.375))  # TPOT over
    assert slo.met_by(_request(0.0, 0.5, 99.0, tokens=1))  # one token: no TPOT, only TTFT counts
    assert not slo.met_by(RequestResult(start=0.0, end=0.5, error="HTTP 503"))
    assert SLO().as_dict() == {"ttft_ms": 2000.0, "tpot_ms": 50.0}


def test_goodput_counts_requests_and_tokens_that_met_the_slo_over_the_whole_run():
    results = [
        _request(0.0, 0.5, 0.125, tokens=5),  # meets
        _request(0.0, 3.0, 0.125, tokens=5),  # TTFT 3 s > 2 s
        _request(1.0, 0.25, 0.0625, tokens=9),  # meets
        _request(2.0, 0.25, 0.5, tokens=3),  # TPOT 0.5 s > 0.25 s
        RequestResult(start=3.0, end=3.5, error="HTTP 500"),
    ]
    out = goodput(results, duration_s=4.0, slo=SLO(ttft_s=2.0, tpot_s=0.25))
    assert out == {"goodput_req_s": 2 / 4.0, "goodput_tok_s": (5 + 9) / 4.0, "slo_attainment": 2 / 5}
    assert math.isnan(goodput([], 0.0, SLO())["slo_attainment"])


def test_summary_reports_p50_p90_p99_of_ttft_tpot_itl_e2e_and_goodput():
    # TTFTs 0.1 .. 1.0 s; TPOT 10 ms for all; 3 tokens each, so each request has two 10 ms gaps
    results = [_request(0.0, 0.1 * k, 0.01, tokens=3) for k in range(1, 11)]
    s = summarize(results, SLO(ttft_s=0.5, tpot_s=0.05))
    # ranks over 10 sorted values: p50 -> 4.5, p90 -> 8.1, p99 -> 8.91 (numpy's linear interpolation)
    assert s["ttft_p50_ms"] == pytest.approx(550.0)
    assert s["ttft_p90_ms"] == pytest.approx(910.0)
    assert s["ttft_p99_ms"] == pytest.approx(991.0)
    assert s["tpot_p50_ms"] == pytest.approx(10.0) and s["tpot_p99_ms"] == pytest.approx(10.0)
    assert s["itl_p50_ms"] == pytest.approx(10.0) and s["itl_p90_ms"] == pytest.approx(10.0)
    # E2E = TTFT + 20 ms
    assert s["e2e_p50_ms"] == pytest.approx(570.0) and s["e2e_p90_ms"] == pytest.approx(930.0)
    assert s["e2e_p99_ms"] == pytest.approx(1011.0)
    assert s["duration_s"] == pytest.approx(1.02)
    assert s["slo_attainment"] == 0.5  # TTFT 0.1 .. 0.5 s meet the 0.5 s target
    assert s["goodput_req_s"] == pytest.approx(5 / 1.02)
    assert s["goodput_tok_s"] == pytest.approx(15 / 1.02)


def test_summary_goodput_uses_the_default_slo_when_none_is_given():
    slow = [_request(0.0, 2.5, 0.01), _request(0.0, 0.5, 0.06), _request(0.0, 0.5, 0.04)]
    assert summarize(slow)["slo_attainment"] == pytest.approx(1 / 3)  # only the last: TTFT <= 2 s, TPOT <= 50 ms
