"""One scrape of a server's /metrics (Prometheus text), kept as plain numbers."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

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

