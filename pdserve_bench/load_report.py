"""Tables and plots of `load` records (the `report` subcommand calls `load_section`).

- `load_table`: per target and figure, what the percentile table lacks: start-up, the first window
  against the rest, the servers' own means, and the mixed workload's classes apart.
- `phase_table`: per target and figure, where the time to first token went: p50 / mean ms of each
  phase (server/telemetry/phases.py).
- `load_section`: that table and the percentile table of every load record, then per figure a
  time-series plot (mean TTFT and output tok/s per second; one line per target and repeat, so a
  fresh server's first run stands out) and, where several targets ran it, bars side by side.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pdserve_bench.stats import Summary
from pdserve_bench.tables import percentile_table, table
from server.telemetry.phases import TTFT_PHASES

Record = Mapping[str, Any]
COMMAND = "load"
_LOAD_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("err", "errors", "{:.0f}"),
    ("start-up s", "startup_s", "{:.1f}"),
    ("TTFT mean ms", "ttft_mean_ms", "{:.1f}"),
    ("first window TTFT ms", "ttft_mean_first_window_ms", "{:.1f}"),
    ("later TTFT ms", "ttft_mean_later_ms", "{:.1f}"),
    ("first / later", "first_vs_later_ttft", "{:.2f}"),
    ("server TTFT mean ms", "server_ttft_mean_ms", "{:.1f}"),
    ("server queue mean ms", "server_queue_mean_ms", "{:.1f}"),
    ("bg TPOT p50", "background_tpot_p50_ms", "{:.2f}"),
    ("bg TPOT p99", "background_tpot_p99_ms", "{:.2f}"),
    ("bg ITL p99", "background_itl_p99_ms", "{:.2f}"),
    ("long TTFT p50", "long_ttft_p50_ms", "{:.1f}"),
    ("long TPOT p99", "long_tpot_p99_ms", "{:.2f}"),
    ("busiest client core", "client_busiest_core_share", "{:.0%}"),
)


# (figure key, label) of the bars of several targets side by side
BARS = (("ttft_p50_ms", "TTFT p50 ms"), ("tpot_p50_ms", "TPOT p50 ms"), ("output_tok_s", "output tok/s"),
        ("goodput_req_s", "goodput req/s"))
MIXED_BARS = (("background_tpot_p50_ms", "background TPOT p50 ms"),
              ("background_tpot_p99_ms", "background TPOT p99 ms"),
              ("background_itl_p99_ms", "background ITL p99 ms"),
              ("long_ttft_p50_ms", "long TTFT p50 ms"), ("goodput_req_s", "goodput req/s"))


def load_table(rows: Sequence[tuple[str, Summary]]) -> str:
    return table(rows, _LOAD_COLUMNS, "target: figure")


def phase_table(rows: Sequence[tuple[str, Summary]]) -> str:
    """One row per target: each phase's p50 / mean ms ("-" where no scraped server observed it)."""
    def cell(summary: Summary, name: str) -> str:
        p50, mean = (summary.get(f"phase_{name}_{k}_ms", math.nan) for k in ("p50", "mean"))
        return "-" if math.isnan(mean) else f"{p50:.1f} / {mean:.1f}"

    header = ["TTFT phases, p50 / mean ms", *(p.name.replace("_", " ") for p in TTFT_PHASES)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join([name, *(cell(s, p.name) for p in TTFT_PHASES)]) + " |" for name, s in rows]
    return "\n".join(lines)


def run_line(name: str, repeat: int, of: int, summary: Summary) -> str:
    """The progress line of one run."""
    line = (f"  [{name} run {repeat + 1}/{of}] {summary['requests']:.0f} requests, {summary['errors']:.0f} errors, "
            f"{summary['output_tok_s']:.1f} tok/s, TTFT mean {summary['ttft_mean_ms']:.1f} ms "
            f"(first window {summary['ttft_mean_first_window_ms']:.1f}), TPOT p50 {summary['tpot_p50_ms']:.2f} ms")
    server = summary.get("server_ttft_mean_ms", math.nan)
    return line + ("" if math.isnan(server) else f", server TTFT mean {server:.1f} ms")


def is_load(record: Record) -> bool:
    return record["command"] == COMMAND and "figure" in record["config"]


def _by_figure(records: Sequence[Record]) -> dict[str, dict[str, Record]]:
    """figure -> target -> the latest record of that point."""
    out: dict[str, dict[str, Record]] = {}
    for record in records:
        if is_load(record):
            out.setdefault(record["config"]["figure"], {})[record["config"]["target"]] = record
    return out


def _plots(figure: str, by_target: Mapping[str, Record], out: Path, prefix: str) -> list[Path]:
    from pdserve_bench import plots
    from pdserve_bench.report import slug

    base = out / f"{prefix}load-{slug(figure)}"
    lines = [(f"{target} run {i + 1}", s) for target, r in by_target.items() for i, s in enumerate(r.get("series", []))]
    written = [plots.time_series(lines, f"load {figure}: per second", Path(f"{base}-series.png"))] if lines else []
    if len(by_target) > 1:
        mixed = any("background_tpot_p99_ms" in r["figures"] for r in by_target.values())
        keys = [plots.Metric(key, label) for key, label in (MIXED_BARS if mixed else BARS)]
        written.append(plots.grouped_bars({figure: dict(by_target)}, keys, f"load {figure}: side by side",
                                          Path(f"{base}-targets.png")))
    return written


def load_section(records: Sequence[Record], out: Path, prefix: str) -> tuple[list[str], list[Path]]:
    """The report's markdown lines for the load records, and the PNGs written for them."""
    figures = _by_figure(records)
    if not figures:
        return [], []
    rows = [(f"{target}: {figure}", r["figures"]) for figure, by_target in figures.items()
            for target, r in by_target.items()]
    lines = ["## Load", "", percentile_table(rows), "", load_table(rows), ""]
    if any(key.startswith("phase_") for _, summary in rows for key in summary):
        lines += [phase_table(rows), ""]
    pngs = []
    for figure, by_target in figures.items():
        written = _plots(figure, by_target, out, prefix)
        pngs += written
        lines += [f"![{png.stem}]({png.name})" for png in written]
    return lines, pngs
