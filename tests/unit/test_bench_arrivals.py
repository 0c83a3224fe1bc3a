"""The load bench's arrival schedules: seeded Poisson arrivals (with and without a ramp) and
staggered closed-loop starts. Seeded, so every statistic below is one fixed, reproducible draw."""

from __future__ import annotations

import math
import statistics

import pytest

from pdserve_bench.arrivals import (
    cumulative_rate,
    inverse_cumulative_rate,
    poisson_offsets,
    shares,
    stream_starts,
)


def test_the_same_seed_gives_the_same_arrivals_and_another_seed_others():
    a = poisson_offsets(4.0, seed=7, duration_s=30.0)
    assert a == poisson_offsets(4.0, seed=7, duration_s=30.0)
    assert a != poisson_offsets(4.0, seed=8, duration_s=30.0)
    assert a == sorted(a) and 0.0 < a[0] and a[-1] < 30.0


def test_poisson_arrivals_have_the_rate_and_exponential_gaps():
    rate, duration = 10.0, 400.0
    offsets = poisson_offsets(rate, seed=3, duration_s=duration)
    expected = rate * duration  # 4,000 arrivals; a Poisson count's standard deviation is sqrt(4,000) = 63
    assert abs(len(offsets) - expected) < 4 * math.sqrt(expected)
    gaps = [b - a for a, b in zip([0.0, *offsets], offsets, strict=False)]
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(1 / rate, rel=0.05)
    assert statistics.stdev(gaps) / mean == pytest.approx(1.0, abs=0.05)  # exponential: CV 1
    below_median = sum(g < math.log(2) / rate for g in gaps) / len(gaps)  # exponential median: ln 2 / rate
    assert below_median == pytest.approx(0.5, abs=0.03)
    per_second = [0] * int(duration)
    for t in offsets:
        per_second[int(t)] += 1
    dispersion = statistics.pvariance(per_second) / statistics.fmean(per_second)  # Poisson counts: 1
    assert dispersion == pytest.approx(1.0, abs=0.15)


def test_a_count_bounds_the_arrivals_and_the_duration_still_applies():
    assert len(poisson_offsets(5.0, seed=1, count=50)) == 50
    assert poisson_offsets(5.0, seed=1, count=50) == poisson_offsets(5.0, seed=1, count=80)[:50]
    bounded = poisson_offsets(5.0, seed=1, count=1000, duration_s=2.0)
    assert bounded == poisson_offsets(5.0, seed=1, duration_s=2.0) and len(bounded) < 1000


def test_a_ramp_maps_the_same_draws_through_the_cumulative_rate():
    rate, ramp = 8.0, 10.0
    flat = poisson_offsets(rate, seed=5, count=200)
    ramped = poisson_offsets(rate, seed=5, count=200, ramp_s=ramp)
    # the k-th arrival comes when rate * t_k (flat) arrivals are due under the ramped rate
    assert ramped == [pytest.approx(inverse_cumulative_rate(rate * t, rate, ramp)) for t in flat]
    assert all(b >= a for a, b in zip(flat, ramped, strict=True))  # a ramp only delays arrivals
    in_ramp = sum(t < ramp for t in ramped)
    assert abs(in_ramp - rate * ramp / 2) < 4 * math.sqrt(rate * ramp / 2)  # half the flat count


@pytest.mark.parametrize("t", [0.0, 0.5, 3.0, 9.99, 10.0, 25.0])
def test_the_cumulative_rate_and_its_inverse(t):
    rate, ramp = 4.0, 10.0
    assert inverse_cumulative_rate(cumulative_rate(t, rate, ramp), rate, ramp) == pytest.approx(t)
    assert cumulative_rate(t, rate, 0.0) == rate * t
    assert cumulative_rate(20.0, rate, ramp) == rate * 15.0  # 20 s at full rate, less half the ramp


def test_bad_schedules_are_refused():
    with pytest.raises(ValueError, match="rate"):
        poisson_offsets(0.0, seed=1, count=3)
    with pytest.raises(ValueError, match="duration or a request count"):
        poisson_offsets(1.0, seed=1)
    with pytest.raises(ValueError, match="concurrency"):
        stream_starts(0, 1.0)
    with pytest.raises(ValueError, match="parts"):
        shares(3, 0)


def test_closed_loop_streams_start_staggered_and_counts_split_evenly():
    assert stream_starts(4, 2.0) == [0.0, 0.5, 1.0, 1.5]
    assert stream_starts(3, 0.0) == [0.0, 0.0, 0.0]
    assert shares(10, 4) == [3, 3, 2, 2]
    assert shares(2, 4) == [1, 1, 0, 0]
    assert sum(shares(1001, 7)) == 1001
