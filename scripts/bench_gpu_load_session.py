"""What scripts/bench_gpu_load.py keeps while it runs, and what it writes at the end.

`Session` prints one JSON line per figure, times phases (a phase that raises prints its error and
the run goes on with the next one), measures groups of load runs (`runs`: one `load` record each,
with every run's per-second series), checks goals (`goal`: a `Comparison`) and at the end prints
the SUMMARY line and writes a `gpu-load` record, report.md and three plots (plots/).
"""

from __future__ import annotations

import argparse
import json
import math
import time
import traceback
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pdserve_bench.load_client import LoadPlan
from pdserve_bench.load_job import Traffic
from pdserve_bench.load_report import BARS, MIXED_BARS, load_table
from pdserve_bench.load_target import LoadTarget, measure_run
from pdserve_bench.record import RecordWriter
from pdserve_bench.stats import SLO, Summary, median_summary
from pdserve_bench.tables import Comparison, comparisons_table, percentile_table

LONG_SEED_OFFSET = 500_000


def closed_plan(args: argparse.Namespace, concurrency: int, seed: int, *, duration_s: float | None = None,
                count: int | None = None) -> LoadPlan:
    """`concurrency` streams of INPUT in / OUTPUT out, staggered over --ramp-s (no ramp for a count)."""
    main = Traffic("main", args.input_len, args.output_len, concurrency=concurrency, count=count, seed=seed)
    return LoadPlan((main,), None if count else duration_s, 0.0 if count else args.ramp_s)


def mixed_plan(args: argparse.Namespace, seed: int) -> LoadPlan:
    """Background streams decoding while long prompts arrive (Poisson, --long-rate)."""
    background = Traffic("background", args.input_len, args.output_len, concurrency=args.mixed_concurrency,
                         seed=seed)
    long = Traffic("long", args.long_input_len, args.long_output_len, rate=args.long_rate,
                   seed=seed + LONG_SEED_OFFSET)
    return LoadPlan((background, long), args.mixed_duration, args.ramp_s)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


class Session:
    def __init__(self, args: argparse.Namespace, writer: RecordWriter, server_env: Mapping[str, str]) -> None:
        self.args, self.writer, self.server_env = args, writer, dict(server_env)
        self.slo = SLO(args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
        self.engine: dict[str, Any] = {}
        self.figures: dict[str, float] = {}
        self.comparisons: dict[str, Comparison] = {}
        self.groups: dict[str, dict[str, Any]] = {}  # label -> the load record of that group of runs
        self.vocab: list[int] = []
        self.config: dict[str, Path] = {}  # deployment files: agg, disagg, restart
        self.started = time.perf_counter()
        self._seed = 0

    def seed(self) -> int:
        """A fresh seed per run: no prompt is ever sent twice (no prefix-cache hits across runs)."""
        self._seed += 1
        return 1_000 * self._seed

    def emit(self, name: str, **values: Any) -> None:
        print(json.dumps({"figure": name, **values}), flush=True)
        self.figures |= {f"{name}.{k}": float(v) for k, v in values.items() if _number(v)}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        except Exception as exc:  # noqa: BLE001 (one device call: the next phase still runs)
            traceback.print_exc()
            print(json.dumps({"phase": name, "error": f"{type(exc).__name__}: {exc}"[:2000]}), flush=True)
        print(json.dumps({"phase": name, "elapsed_s": round(time.perf_counter() - start, 1),
                          "total_s": round(time.perf_counter() - self.started, 1)}), flush=True)

    def runs(self, target: LoadTarget, who: str, figure: str, plans: Sequence[LoadPlan]) -> list[Summary]:
        """Each plan once on `target`; one `load` record for the group (medians, each run, each series),
        kept as `groups["WHO FIGURE"]`. `pdserve-bench report` draws WHOs of one FIGURE together."""
        found = []
        label = f"{who} {figure}"
        for index, plan in enumerate(plans):
            summary, series = measure_run(target, plan, self.vocab, self.args.client_procs, self.slo,
                                          self.args.window_s, 1.0)
            found.append((summary, series))
            print(json.dumps({"figure": label, "run": index + 1, **_brief(summary)}), flush=True)
        summaries = [s for s, _ in found]
        config = {"target": who, "figure": figure, "server": target.name, "plan": _plan_config(plans[0]),
                  "runs": len(plans), "slo": self.slo.as_dict(), "client_procs": self.args.client_procs}
        self.groups[label] = self.writer.write("load", config, median_summary(summaries), summaries,
                                               [c for _, c in found])
        return summaries

    def goal(self, key: str, name: str, numerator: float | None, denominator: float | None, goal: float,
             at_least: bool) -> None:
        value = lambda x: math.nan if x is None else float(x)
        c = Comparison(name, value(numerator), value(denominator), goal, at_least)
        self.comparisons[key] = c
        print(json.dumps({"figure": "goal", "key": key, **c.as_dict()}), flush=True)
        self.figures |= {key: c.value, f"{key}.numerator": c.numerator, f"{key}.denominator": c.denominator}

    def finish(self, out: Path) -> None:
        self.figures["total_s"] = time.perf_counter() - self.started
        summary = {"goals": {k: {"ratio": c.value, "goal": c.goal, "verdict": c.verdict}
                             for k, c in self.comparisons.items()}, "total_s": round(self.figures["total_s"], 1)}
        print("SUMMARY " + json.dumps(summary), flush=True)
        config = {"argv_sizes": {k: v for k, v in vars(self.args).items() if _number(v)}, "slo": self.slo.as_dict(),
                  "model": self.engine.get("model")}
        self.writer.write("gpu-load", config, self.figures)
        (out / "report.md").write_text(report_markdown(self))
        try:
            write_plots(self, out / "plots")
        except ImportError as exc:  # matplotlib: `pdserve-bench report records.jsonl` draws them elsewhere
            print(f"no plots: {exc}", flush=True)


KEYS = ("requests", "errors", "output_tok_s", "steady_output_tok_s", "ttft_mean_ms", "ttft_p50_ms", "tpot_p50_ms",
        "tpot_p99_ms", "itl_p99_ms", "server_ttft_mean_ms", "server_queue_mean_ms", "first_vs_later_ttft",
        "background_tpot_p50_ms", "background_tpot_p99_ms", "background_itl_p99_ms", "long_ttft_p50_ms",
        "goodput_req_s", "slo_attainment", "client_busiest_core_share", "chunks_per_token")


def _brief(summary: Summary) -> dict[str, float | None]:
    return {k: (None if math.isnan(summary[k]) else round(summary[k], 3)) for k in KEYS if k in summary}


def _plan_config(plan: LoadPlan) -> dict[str, Any]:
    return {"duration_s": plan.duration_s, "ramp_s": plan.ramp_s,
            "traffic": [{"name": t.name, "input_len": t.input_len, "output_len": t.output_len,
                         "concurrency": t.concurrency, "rate": t.rate, "count": t.count} for t in plan.traffic]}


def report_markdown(s: Session) -> str:
    rows = [(label, r["figures"]) for label, r in s.groups.items()]
    engine = ", ".join(f"{k} {v:.4g}" if _number(v) else f"{k} {v}" for k, v in s.engine.items())
    lines = ["# Serving under load (scripts/bench_gpu_load.py)", "", f"Engine (phase a): {engine}", "",
             f"Goodput SLO: TTFT <= {s.args.slo_ttft_ms:g} ms, TPOT <= {s.args.slo_tpot_ms:g} ms.", "",
             "## Goals", "", comparisons_table(list(s.comparisons.values())), "", "## Runs", "",
             percentile_table(rows), "", load_table(rows), ""]
    lines += [f"![{name}](plots/{name}.png)" for name in PLOTS]
    return "\n".join(lines) + "\n"


PLOTS = ("first-runs", "peak", "mixed")


def write_plots(s: Session, folder: Path) -> list[Path]:
    """The fresh and the restarted server's runs per second; agg vs disagg at the peak and mixed."""
    from pdserve_bench import plots

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    first = [f"{who} first runs" for who in ("fresh", "restarted") if f"{who} first runs" in s.groups]
    lines = [(f"{label.split()[0]} run {i + 1}", series) for label in first
             for i, series in enumerate(s.groups[label].get("series", []))]
    if lines:
        written.append(plots.time_series(lines, "first runs of a fresh and a restarted server",
                                         folder / "first-runs.png"))
    for name, bars in (("peak", BARS), ("mixed", MIXED_BARS)):
        group = {who: s.groups[f"{who} {name}"] for who in ("agg", "disagg") if f"{who} {name}" in s.groups}
        if group:
            metrics = [plots.Metric(k, label) for k, label in bars]
            written.append(plots.grouped_bars({name: group}, metrics, f"{name}: aggregated vs disaggregated",
                                              folder / f"{name}.png"))
    return written
