"""One scrape of a server's /metrics kept as plain numbers (`Sample`), and the last minute of them
from one source (`Window`): counter increases, rates and histogram quantiles.

A counter lower than before is counted from zero (a restart), as Prometheus' `increase` does. A
source whose last sample is older than STALE_S has no rate."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from server.telemetry.phases import quantile

WINDOW_S = 60.0  # percentiles and hit rates are over this span
RATE_S = 10.0  # rates (per second) are over this span: short enough to follow the load
STALE_S = 5.0  # a source whose newest sample is older than this has no rate
Labels = Mapping[str, str]


@dataclass(frozen=True)
class Sample:
    """Every series of one scrape: sample name ("x_total", "x_bucket", ...) -> [(labels, value)]."""

    t: float  # time.monotonic() of the scrape
    series: Mapping[str, list[tuple[Labels, float]]]

    def value(self, name: str, **labels: str) -> float:
        """Sum of the series `name` whose labels include `labels` (0 if there is none)."""
        return sum(v for lab, v in self.series.get(name, ()) if _matches(lab, labels))

    def by_label(self, name: str, label: str, **labels: str) -> dict[str, float]:
        """label value -> sum of the series `name` with that label value (and `labels`)."""
        out: dict[str, float] = {}
        for lab, v in self.series.get(name, ()):
            if label in lab and _matches(lab, labels):
                out[lab[label]] = out.get(lab[label], 0.0) + v
        return out

    def buckets(self, histogram: str, **labels: str) -> dict[float, float]:
        """Upper bound (math.inf for +Inf) -> cumulative count of a histogram's buckets with `labels`."""
        return {math.inf if le == "+Inf" else float(le): v
                for le, v in self.by_label(f"{histogram}_bucket", "le", **labels).items()}


def parse_metrics(text: str, t: float) -> Sample:
    """A Sample of a Prometheus text exposition (ValueError if it is not one)."""
    series: dict[str, list[tuple[Labels, float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not s.name.endswith("_created"):
                series.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return Sample(t, series)


def _matches(labels: Labels, wanted: Mapping[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in wanted.items())


class Window:
    def __init__(self) -> None:
        self.samples: deque[Sample] = deque()

    def add(self, sample: Sample) -> None:
        self.samples.append(sample)
        while self.samples and self.samples[0].t < sample.t - WINDOW_S:
            self.samples.popleft()

    @property
    def latest(self) -> Sample | None:
        return self.samples[-1] if self.samples else None

    def fresh(self, now: float) -> bool:
        return bool(self.samples) and now - self.samples[-1].t <= STALE_S

    def recent(self, now: float, seconds: float) -> list[Sample]:
        """The samples of the `seconds` before `now`."""
        return [s for s in self.samples if s.t >= now - seconds]

    def increase(self, name: str, now: float, seconds: float = WINDOW_S, **labels: str) -> float:
        return counter_increase(s.value(name, **labels) for s in self.recent(now, seconds))

    def rate(self, name: str, now: float, seconds: float = RATE_S, **labels: str) -> float | None:
        """Increase per second over the last `seconds`; None until two samples span time, or when stale."""
        samples = self.recent(now, seconds)
        span = samples[-1].t - samples[0].t if samples else 0.0
        if span <= 0 or not self.fresh(now):
            return None
        return counter_increase(s.value(name, **labels) for s in samples) / span

    def bucket_increase(self, histogram: str, now: float, seconds: float = WINDOW_S,
                        **labels: str) -> dict[float, float]:
        """Upper bound -> increase of that (cumulative) bucket over the last `seconds`."""
        samples = self.recent(now, seconds)
        bounds = samples[-1].buckets(histogram, **labels).keys() if samples else ()
        per_sample = [s.buckets(histogram, **labels) for s in samples]
        return {le: counter_increase(b.get(le, 0.0) for b in per_sample) for le in bounds}


def counter_increase(values: Iterable[float]) -> float:
    total, previous = 0.0, None
    for v in values:
        if previous is not None:
            total += v - previous if v >= previous else v  # lower: the counter restarted from zero
        previous = v
    return total


def merge_buckets(histograms: Iterable[Mapping[float, float]]) -> dict[float, float]:
    out: dict[float, float] = {}
    for h in histograms:
        for le, count in h.items():
            out[le] = out.get(le, 0.0) + count
    return out


def percentiles(buckets: Mapping[float, float], qs: tuple[float, ...] = (0.5, 0.9, 0.99)) -> dict:
    """{"p50": s, "p90": s, "p99": s, "count": n} of cumulative buckets (None values when empty)."""
    out: dict = {f"p{round(q * 100)}": quantile(q, buckets) for q in qs}
    out["count"] = max(buckets.values(), default=0.0)
    return out
