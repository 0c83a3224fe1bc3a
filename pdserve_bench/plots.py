"""PNG plots of serving records (matplotlib, Agg backend: no display needed).

Every function takes records already grouped (see report.py) and writes one PNG. A record's
`figures` hold the medians over its repeats; bar charts draw the repeats' range as a whisker.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

Record = Mapping[str, Any]
DPI = 100
PANEL_W, PANEL_H = 3.7, 3.1


@dataclass(frozen=True)
class Series:
    """One line or one bar colour: a target's records, ordered by concurrency."""

    label: str
    records: Sequence[Record]

    def x(self) -> list[int]:
        return [r["config"]["concurrency"] for r in self.records]

    def y(self, key: str) -> list[float]:
        return [r["figures"].get(key, math.nan) for r in self.records]


@dataclass(frozen=True)
class Metric:
    key: str
    label: str


def _panels(count: int, title: str):
    fig, axes = plt.subplots(1, count, figsize=(PANEL_W * count, PANEL_H + 0.4), dpi=DPI, squeeze=False)
    fig.suptitle(title, fontsize=10)
    return fig, list(axes[0])


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def _concurrency_axis(ax, values: Sequence[int]) -> None:
    ticks = sorted(set(values))
    if len(ticks) > 1 and ticks[0] > 0:
        ax.set_xscale("log", base=2)
    ax.set_xticks(ticks)
    ax.set_xticklabels([str(t) for t in ticks])
    ax.set_xlabel("concurrency")


def latency_vs_concurrency(series: Sequence[Series], title: str, path: Path) -> Path:
    """TTFT and TPOT (p50 solid, p90 dashed) against concurrency, one colour per target."""
    fig, axes = _panels(2, title)
    for ax, name in zip(axes, ("ttft", "tpot"), strict=True):
        for index, s in enumerate(series):
            colour = f"C{index}"
            ax.plot(s.x(), s.y(f"{name}_p50_ms"), "o-", color=colour, label=f"{s.label} p50")
            ax.plot(s.x(), s.y(f"{name}_p90_ms"), "s--", color=colour, alpha=0.6, label=f"{s.label} p90")
        _concurrency_axis(ax, [c for s in series for c in s.x()])
        ax.set_ylabel(f"{name.upper()} ms")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    return _save(fig, path)


def throughput_vs_latency(series: Sequence[Series], title: str, path: Path) -> Path:
    """Output tok/s against median TTFT and median TPOT; each point labelled with its concurrency."""
    fig, axes = _panels(2, title)
    for ax, (key, label) in zip(axes, (("ttft_p50_ms", "TTFT p50 ms"), ("tpot_p50_ms", "TPOT p50 ms")),
                                strict=True):
        for index, s in enumerate(series):
            xs, ys = s.y(key), s.y("output_tok_s")
            ax.plot(xs, ys, "o-", color=f"C{index}", label=s.label)
            for x, y, c in zip(xs, ys, s.x(), strict=True):
                ax.annotate(f"c={c}", (x, y), textcoords="offset points", xytext=(3, 3), fontsize=7)
        ax.set_xlabel(label)
        ax.set_ylabel("output tok/s")
        ax.margins(0.12)
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    return _save(fig, path)


def _spread(record: Record, key: str) -> tuple[float, float]:
    """(median - min, max - median) over the record's repeats; 0 where there is nothing to show."""
    median = record["figures"].get(key, math.nan)
    values = [r[key] for r in record["repeats"] if key in r and not math.isnan(r[key])]
    if not values or math.isnan(median):
        return 0.0, 0.0
    return max(median - min(values), 0.0), max(max(values) - median, 0.0)


def grouped_bars(groups: Mapping[str, Mapping[str, Record]], metrics: Sequence[Metric], title: str,
                 path: Path) -> Path:
    """One panel per metric; along x the groups (e.g. `c=8`), in each group one bar per series label."""
    labels = list(dict.fromkeys(label for by_label in groups.values() for label in by_label))
    width = 0.8 / max(len(labels), 1)
    fig, axes = _panels(len(metrics), title)
    for ax, metric in zip(axes, metrics, strict=True):
        for index, label in enumerate(labels):
            xs, heights, errors = [], [], ([], [])
            for position, by_label in enumerate(groups.values()):
                record = by_label.get(label)
                if record is None:
                    continue
                xs.append(position + (index - (len(labels) - 1) / 2) * width)
                heights.append(record["figures"].get(metric.key, math.nan))
                low, high = _spread(record, metric.key)
                errors[0].append(low)
                errors[1].append(high)
            ax.bar(xs, heights, width, yerr=errors, capsize=2, color=f"C{index}", label=label)
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels(list(groups), fontsize=8)
        ax.set_ylabel(metric.label)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=7)
    return _save(fig, path)


def time_series(lines: Sequence[tuple[str, Mapping[str, Sequence[float]]]], title: str, path: Path) -> Path:
    """Mean TTFT and output tok/s per time bin, one line per (label, series columns `t_s`,
    `ttft_mean_ms`, `output_tok_s`): a server's first run against its later ones."""
    fig, axes = _panels(2, title)
    for ax, (key, label) in zip(axes, (("ttft_mean_ms", "mean TTFT ms"), ("output_tok_s", "output tok/s")),
                                strict=True):
        for index, (name, columns) in enumerate(lines):
            ax.plot(columns["t_s"], columns[key], "-", color=f"C{index % 10}", label=name, linewidth=1.2)
        ax.set_xlabel("seconds from the run's start")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    return _save(fig, path)
