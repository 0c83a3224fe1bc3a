"""Records (JSON lines) -> a markdown report and PNG plots.

    pdserve-bench report bench-results/records.jsonl [more.jsonl ...] --out docs/bench --prefix cpu-

Serving records (sweep, compare, hf) are grouped by workload; per workload:
- TTFT and TPOT (p50, p90) against concurrency, and output tok/s against median TTFT / TPOT, one
  line per target (deployment, with `reuse=off` when block reuse was off), where a target has more
  than one concurrency;
- deployments side by side (e.g. aggregated vs disaggregated), where a workload ran on several;
- block reuse on vs off, where a deployment ran with both;
- the length grid: per grid point and concurrency, one bar per target.
`load` records get their own section (pdserve_bench/load_report.py): the percentile and load tables,
per figure a per-second time series of every run and, for several targets, bars side by side.
The markdown holds the percentile tables (TTFT / TPOT / ITL / E2E p50, p90, p99; goodput within
the SLO the records name), the goal comparisons of `compare` records, one table per other command,
and links to the PNGs (`report.md`, or `PREFIXreport.md`). Needs matplotlib (`pip install -e '.[bench]'`).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pdserve_bench.goals import comparisons_of, runs_from_records
from pdserve_bench.load_report import is_load, load_section
from pdserve_bench.record import read_records
from pdserve_bench.tables import comparisons_table, percentile_table

HELP = "records (JSON lines) -> markdown tables and PNG plots"
Record = Mapping[str, Any]
SERVING = ("sweep", "compare", "hf")
REPORT_FILE = "report.md"  # with --prefix P: Preport.md


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("records", type=Path, nargs="+", help="records.jsonl files (or folders holding one)")
    parser.add_argument("--out", type=Path, help="folder for report.md and the PNGs (default: beside the first)")
    parser.add_argument("--prefix", default="", help="prepended to every file name, e.g. cpu-")
    parser.add_argument("--title", default="Benchmark report")


def is_serving(record: Record) -> bool:
    return (record["command"] in SERVING and "ttft_p50_ms" in record["figures"]
            and {"figure", "concurrency"} <= record["config"].keys())


def family(record: Record) -> str:
    """The workload a serving record belongs to, as plotted together (all its concurrencies)."""
    config = record["config"]
    kind = config.get("workload", "random")
    if kind == "grid":
        return f"grid x{config.get('scale', '1')}"
    if kind == "random":
        return f"random {config.get('input_len')}in-{config.get('output_len')}out"
    return kind


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower()


def latest_points(records: Sequence[Record]) -> dict[str, dict[tuple[str, str], Record]]:
    """family -> (target, figure) -> record; a later record of the same point replaces an earlier one."""
    out: dict[str, dict[tuple[str, str], Record]] = {}
    for record in records:
        if is_serving(record):
            config = record["config"]
            out.setdefault(family(record), {})[(config.get("target", record["command"]), config["figure"])] = record
    return out


def _by_target(points: Mapping[tuple[str, str], Record]) -> dict[str, list[Record]]:
    series: dict[str, list[Record]] = {}
    for (target, _), record in points.items():
        series.setdefault(target, []).append(record)
    return {t: sorted(rs, key=lambda r: r["config"]["concurrency"]) for t, rs in series.items()}


def side_by_side_groups(points: Mapping[tuple[str, str], Record]) -> dict[str, dict[str, Record]]:
    """`c=N` -> target -> record, over the targets with block reuse on (or as they run); empty when
    fewer than two deployments ran this workload."""
    kept = [r for r in points.values() if r["config"].get("reuse") is not False]
    if len({r["config"].get("deployment") for r in kept}) < 2:
        return {}
    groups: dict[str, dict[str, Record]] = {}
    for record in sorted(kept, key=lambda r: r["config"]["concurrency"]):
        groups.setdefault(f"c={record['config']['concurrency']}", {})[record["config"]["target"]] = record
    return groups


def reuse_groups(points: Mapping[tuple[str, str], Record]) -> dict[str, dict[str, Record]]:
    """`DEPLOYMENT c=N` -> `reuse on` / `reuse off` -> record, for deployments measured both ways."""
    groups: dict[str, dict[str, Record]] = {}
    for record in sorted(points.values(), key=lambda r: r["config"]["concurrency"]):
        reuse = record["config"].get("reuse")
        if reuse is not None:
            key = f"{record['config'].get('deployment')} c={record['config']['concurrency']}"
            groups.setdefault(key, {})["reuse on" if reuse else "reuse off"] = record
    return {key: pair for key, pair in groups.items() if len(pair) == 2}


def grid_groups(points: Mapping[tuple[str, str], Record]) -> dict[str, dict[str, Record]]:
    """`POINT c=N` (grid order) -> target -> record."""
    groups: dict[str, dict[str, Record]] = {}
    for record in sorted(points.values(), key=lambda r: r["config"]["concurrency"]):
        config = record["config"]
        groups.setdefault(f"{config['grid_point']}\nc={config['concurrency']}", {})[config["target"]] = record
    return groups


def plot_family(name: str, points: Mapping[tuple[str, str], Record], out: Path, prefix: str) -> list[Path]:
    """Every plot this workload's records support; the PNGs written."""
    from pdserve_bench import plots

    base = out / f"{prefix}{slug(name)}"
    metric = plots.Metric
    written = []
    if name.startswith("grid"):
        metrics = [metric("ttft_p50_ms", "TTFT p50 ms"), metric("tpot_p50_ms", "TPOT p50 ms"),
                   metric("output_tok_s", "output tok/s")]
        return [plots.grouped_bars(grid_groups(points), metrics, f"length grid, sizes {name[5:]}",
                                   Path(f"{base}.png"))]
    series = [plots.Series(t, rs) for t, rs in _by_target(points).items()]
    if any(len(s.records) > 1 for s in series):
        written.append(plots.latency_vs_concurrency(series, f"{name}: latency vs concurrency",
                                                    Path(f"{base}-latency.png")))
        written.append(plots.throughput_vs_latency(series, f"{name}: throughput vs latency",
                                                   Path(f"{base}-throughput.png")))
    side = side_by_side_groups(points)
    if side:
        targets = list(dict.fromkeys(t for g in side.values() for t in g))
        metrics = [metric("ttft_p50_ms", "TTFT p50 ms"), metric("tpot_p50_ms", "TPOT p50 ms"),
                   metric("output_tok_s", "output tok/s"), metric("goodput_req_s", "goodput req/s")]
        written.append(plots.grouped_bars(side, metrics, f"{name}: {' vs '.join(targets)}",
                                          Path(f"{base}-deployments.png")))
    reuse = reuse_groups(points)
    if reuse:
        metrics = [metric("ttft_p50_ms", "TTFT p50 ms"), metric("ttft_p90_ms", "TTFT p90 ms"),
                   metric("output_tok_s", "output tok/s"), metric("cache_hit_rate", "prefix hit rate")]
        written.append(plots.grouped_bars(reuse, metrics, f"{name}: block reuse on vs off",
                                          Path(f"{base}-reuse.png")))
    return written


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def provenance(records: Sequence[Record]) -> list[str]:
    """Machines, commits and command lines the records came from."""
    lines = []
    machines = dict.fromkeys((m.get("cpu"), m.get("cores"), m.get("gpu"), m.get("torch"), m.get("transformers"))
                             for m in (r["machine"] for r in records))
    for cpu, cores, gpu, torch, transformers in machines:
        lines.append(f"- machine: {cpu}, {cores} cores" + (f", {gpu}" if gpu else ", no GPU")
                     + f", torch {torch}, transformers {transformers}")
    commits = dict.fromkeys((r["git"].get("commit") or "?", r["git"].get("dirty")) for r in records)
    for commit, dirty in commits:
        lines.append(f"- commit {commit[:10]}" + (" plus uncommitted changes" if dirty else ""))
    for argv in dict.fromkeys(" ".join(r["argv"]) for r in records):
        lines.append(f"- `{argv}`")
    return lines


def serving_section(families: Mapping[str, Mapping[tuple[str, str], Record]],
                    pngs: Mapping[str, list[Path]]) -> list[str]:
    lines = ["## Serving", ""]
    slos = dict.fromkeys(tuple(r["config"]["slo"].items()) for pts in families.values() for r in pts.values()
                         if "slo" in r["config"])
    for slo in slos:
        lines.append("Goodput counts requests within " + ", ".join(f"{k.split('_')[0].upper()} <= {v:g} ms"
                                                                for k, v in slo) + ".")
    for name, points in families.items():
        rows = [(f"{target}: {figure}", r["figures"]) for (target, figure), r in points.items()]
        lines += ["", f"### {name}", "", percentile_table(rows), ""]
        lines += [f"![{png.stem}]({png.name})" for png in pngs.get(name, [])]
    return lines


def other_section(records: Sequence[Record]) -> list[str]:
    """One table per non-serving command: its config and figures, one row per record."""
    lines: list[str] = []
    by_command: dict[str, list[Record]] = {}
    for record in records:
        if not is_serving(record) and not is_load(record):
            by_command.setdefault(record["command"], []).append(record)
    for command, found in by_command.items():
        keys = list(dict.fromkeys(k for r in found for k in r["figures"]))
        lines += ["", f"## {command}", "", "| config | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
        for r in found:
            config = ", ".join(f"{k}={_fmt(v)}" for k, v in r["config"].items())
            lines.append(f"| {config} | " + " | ".join(_fmt(r["figures"].get(k, "")) for k in keys) + " |")
    return lines


def markdown(title: str, records: Sequence[Record], families: Mapping[str, Mapping[tuple[str, str], Record]],
             pngs: Mapping[str, list[Path]], load_lines: Sequence[str] = ()) -> str:
    lines = [f"# {title}", "", f"{len(records)} records.", "", *provenance(records)]
    if families:
        lines += ["", *serving_section(families, pngs)]
    if load_lines:
        lines += ["", *load_lines]
    found = comparisons_of(runs_from_records(records))
    if found:
        lines += ["", "## Goal comparisons (compare)", "", comparisons_table(found)]
    lines += other_section(records)
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    records = read_records(args.records)
    if not records:
        raise SystemExit(f"no records in {', '.join(map(str, args.records))}")
    first = args.records[0]
    out = args.out or (first if first.is_dir() else first.parent) / "report"
    out.mkdir(parents=True, exist_ok=True)
    families = latest_points(records)
    pngs = {name: plot_family(name, points, out, args.prefix) for name, points in families.items()}
    load_lines, load_pngs = load_section(records, out, args.prefix)
    report = out / f"{args.prefix}{REPORT_FILE}"
    report.write_text(markdown(args.title, records, families, pngs, load_lines))
    print(report.read_text())
    print(f"wrote {report} and {sum(len(p) for p in pngs.values()) + len(load_pngs)} PNGs", flush=True)
    return 0
