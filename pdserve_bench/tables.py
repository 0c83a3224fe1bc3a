"""Markdown tables of benchmark figures and of the goal ratios."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve_bench.stats import Summary, ratio

# (header, summary key, format)
_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("reqs", "requests", "{:.0f}"),
    ("err", "errors", "{:.0f}"),
    ("out tok/s", "output_tok_s", "{:.1f}"),
    ("TTFT mean ms", "ttft_mean_ms", "{:.1f}"),
    ("TTFT p50", "ttft_p50_ms", "{:.1f}"),
    ("TTFT p99", "ttft_p99_ms", "{:.1f}"),
    ("TPOT mean ms", "tpot_mean_ms", "{:.2f}"),
    ("TPOT p99", "tpot_p99_ms", "{:.2f}"),
    ("ITL p99 ms", "itl_p99_ms", "{:.2f}"),
    ("E2E p50 ms", "e2e_p50_ms", "{:.1f}"),
    ("hit %", "cache_hit_rate", "{:.0%}"),
    ("server CPU ms/tok", "server_cpu_ms_per_token", "{:.2f}"),
    ("client CPU s", "client_cpu_s", "{:.2f}"),
    ("busy before", "busy_before", "{:.0%}"),
    ("load 1m", "load_1m", "{:.1f}"),
)


def _cell(fmt: str, value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else fmt.format(value)


# the serving report's columns: every percentile, goodput within the SLO
_PERCENTILE_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("reqs", "requests", "{:.0f}"),
    ("err", "errors", "{:.0f}"),
    ("out tok/s", "output_tok_s", "{:.1f}"),
    ("goodput req/s", "goodput_req_s", "{:.2f}"),
    ("SLO met", "slo_attainment", "{:.0%}"),
    *((f"{name} p{p}", f"{name.lower()}_p{p}_ms", fmt) for name, fmt in
      (("TTFT", "{:.1f}"), ("TPOT", "{:.2f}"), ("ITL", "{:.2f}"), ("E2E", "{:.1f}")) for p in (50, 90, 99)),
    ("hit %", "cache_hit_rate", "{:.0%}"),
)


def table(rows: Sequence[tuple[str, Summary]], columns: Sequence[tuple[str, str, str]], first: str) -> str:
    header = [first, *[h for h, _, _ in columns]]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, summary in rows:
        cells = [name, *[_cell(fmt, summary.get(key)) for _, key, fmt in columns]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def figures_table(rows: Sequence[tuple[str, Summary]]) -> str:
    """A markdown table: one row per (figure name, median summary)."""
    return table(rows, _COLUMNS, "figure")


def percentile_table(rows: Sequence[tuple[str, Summary]]) -> str:
    """A markdown table of p50/p90/p99 of TTFT, TPOT, ITL and E2E (ms), tok/s and goodput."""
    return table(rows, _PERCENTILE_COLUMNS, "target: figure")


@dataclass(frozen=True)
class Comparison:
    """`numerator / denominator` of one metric against a goal; `at_least` False means at most."""

    name: str
    numerator: float
    denominator: float
    goal: float
    at_least: bool = True
    paired: float = math.nan  # median over repeats of (numerator_r / denominator_r): drift-robust
    best: float = math.nan  # best run / best run (other load only slows a run down)

    @property
    def value(self) -> float:
        return ratio(self.numerator, self.denominator)

    @property
    def verdict(self) -> str:
        if math.isnan(self.value):
            return "n/a"
        met = self.value >= self.goal if self.at_least else self.value <= self.goal
        return "met" if met else "MISSED"

    def as_dict(self) -> dict[str, object]:
        return {"name": self.name, "ratio": self.value, "goal": self.goal,
                "at_least": self.at_least, "verdict": self.verdict, "paired_ratio": self.paired,
                "best_ratio": self.best,
                "numerator": self.numerator, "denominator": self.denominator}


def comparisons_table(comparisons: Sequence[Comparison]) -> str:
    """ratio: median / median (the verdict); paired: median of per-repeat ratios; best: best / best."""
    lines = ["| comparison | numerator | denominator | ratio | paired | best | goal | verdict |",
             "|---|---|---|---|---|---|---|---|"]
    for c in comparisons:
        goal = f"{'>=' if c.at_least else '<='} {c.goal:g}x"
        lines.append(f"| {c.name} | {_cell('{:.2f}', c.numerator)} | {_cell('{:.2f}', c.denominator)} "
                     f"| {_cell('{:.2f}x', c.value)} | {_cell('{:.2f}x', c.paired)} | {_cell('{:.2f}x', c.best)} "
                     f"| {goal} | {c.verdict} |")
    return "\n".join(lines)
