"""When the requests of a load run start: open-loop Poisson arrivals and closed-loop stream starts.

Offsets are seconds from the run's start. Both kinds can ramp up over `ramp_s`:
- closed loop: stream k of C starts at `ramp_s * k / C` (a staggered start, not C requests at once);
- open loop: the arrival rate grows linearly from 0 to `rate` over `ramp_s`, then stays at `rate`
  (an inhomogeneous Poisson process: a unit-rate process mapped through the inverse of the
  cumulative rate, so the same seed gives the same arrivals at any ramp).
No torch, no I/O: the parent draws the schedule once and hands its parts to the client processes.
"""

from __future__ import annotations

import math
import random


def cumulative_rate(t: float, rate: float, ramp_s: float) -> float:
    """Expected arrivals in [0, t): the integral of a rate ramping linearly to `rate` over `ramp_s`."""
    if ramp_s <= 0 or t >= ramp_s:
        return rate * (t - ramp_s / 2) if ramp_s > 0 else rate * t
    return rate * t * t / (2 * ramp_s)


def inverse_cumulative_rate(expected: float, rate: float, ramp_s: float) -> float:
    """The time by which `expected` arrivals are due (the inverse of `cumulative_rate`)."""
    ramp_arrivals = rate * ramp_s / 2
    if ramp_s <= 0:
        return expected / rate
    if expected < ramp_arrivals:
        return math.sqrt(2 * ramp_s * expected / rate)
    return ramp_s + (expected - ramp_arrivals) / rate


def poisson_offsets(rate: float, *, seed: int, duration_s: float | None = None, count: int | None = None,
                    ramp_s: float = 0.0) -> list[float]:
    """Arrival offsets of a Poisson process of `rate` per second (after the ramp), ascending: those
    before `duration_s`, at most `count` of them (at least one of the two bounds is needed)."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    if duration_s is None and count is None:
        raise ValueError("an open-loop schedule needs a duration or a request count")
    rng = random.Random(seed)
    offsets: list[float] = []
    expected = 0.0
    while count is None or len(offsets) < count:
        expected += rng.expovariate(1.0)  # unit-rate gaps, stretched by the rate below
        t = inverse_cumulative_rate(expected, rate, ramp_s)
        if duration_s is not None and t >= duration_s:
            break
        offsets.append(t)
    return offsets


def stream_starts(concurrency: int, ramp_s: float) -> list[float]:
    """Closed loop: when each of `concurrency` streams sends its first request."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    return [ramp_s * k / concurrency for k in range(concurrency)]


def shares(total: int, parts: int) -> list[int]:
    """`total` split into `parts` counts that differ by at most one, the larger first."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    base, extra = divmod(total, parts)
    return [base + (i < extra) for i in range(parts)]
