"""The goal comparisons of the engine and disaggregation issues, every baseline in the same run.

Parts (`--parts`); every requested server is started first (idle servers cost no CPU), then all
figures of all parts are measured `repeat` times, interleaved, and reduced to medians:
- hf:      transformers `generate`, one request at a time, on the c=1 random prompts;
- agg:     configs/aggregated.yaml, block reuse on: random c=1, random c=8, shared-prefix;
- noreuse: the same server binary and YAML with `enable_block_reuse: false`: shared-prefix, random c=8;
- disagg:  configs/disagg.yaml (router + context + generation): random c=1, random c=8.
Ratios use figures of this one run only.
"""

from __future__ import annotations

import datetime
import math
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Mapping, Set
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from bench_cpu import QuietGate
from bench_hf_baseline import load_model, run_hf_baseline
from bench_hf_baseline import warm_up as hf_warm_up
from bench_launch import REPO, ServerUnderTest
from bench_measure import (
    Figure,
    Runs,
    Target,
    WorkloadArgs,
    measure,
    medians,
    model_vocab,
    own_cpu_s,
    random_figure,
    server_target,
    shared_prefix_figure,
)
from bench_report import Comparison, comparisons_table, figures_table
from bench_stats import RequestResult, Summary, ratio
from transformers import PreTrainedModel

from server.models.builtin import resolve_model


@dataclass(frozen=True)
class HFTarget:
    """transformers `generate` in this process, one request at a time (the figure's concurrency is ignored)."""

    name: str
    model: PreTrainedModel

    def run(self, figure: Figure, repeat: int) -> list[RequestResult]:
        return run_hf_baseline(self.model, figure.workload(repeat))

    def cpu_s(self) -> float:
        return own_cpu_s()  # generate runs in this process


def hf_target(model: str, vocab: list[int]) -> HFTarget:
    print("loading the transformers generate baseline", file=sys.stderr, flush=True)
    hf_model = load_model(resolve_model(model))
    hf_warm_up(hf_model, vocab)
    return HFTarget("hf", hf_model)


def start_server(stack: ExitStack, part: str, config: Path, reuse: bool, vocab: list[int],
                 env: Mapping[str, str]) -> Target:
    print(f"starting {part}: {config} (block reuse {'on' if reuse else 'off'})", file=sys.stderr, flush=True)
    server = ServerUnderTest(config, reuse=reuse, env=env)
    url = stack.enter_context(server)
    return server_target(part, url, vocab, pid=server.pid)


def _series(runs: Runs, part: str, figure: str, key: str) -> list[float] | None:
    found = runs.get(part, {}).get(figure)
    return None if found is None else [summary[key] for summary in found]


def _paired_median(numerators: list[float], denominators: list[float]) -> float:
    values = [ratio(a, b) for a, b in zip(numerators, denominators, strict=True)]
    values = [v for v in values if not math.isnan(v)]
    return statistics.median(values) if values else math.nan


def comparisons(runs: Runs, c1: str, c8: str, shared: str) -> list[Comparison]:
    """Every goal comparison whose two figures (named c1, c8, shared) were measured."""
    tok_s, ttft, cpu = "output_tok_s", "ttft_mean_ms", "server_cpu_ms_per_token"
    specs = [
        ("aggregated c=8 tok/s / HF generate tok/s", ("aggregated", c8, tok_s), ("hf", c1, tok_s), 4.0, True),
        ("aggregated c=1 tok/s / HF generate tok/s", ("aggregated", c1, tok_s), ("hf", c1, tok_s), 1.0, True),
        ("shared-prefix mean TTFT, reuse off / on", ("noreuse", shared, ttft), ("aggregated", shared, ttft),
         3.0, True),
        ("aggregated c=8 tok/s, reuse on / off (0% hits)", ("aggregated", c8, tok_s), ("noreuse", c8, tok_s),
         0.98, True),
        ("disagg c=8 tok/s / aggregated", ("disagg", c8, tok_s), ("aggregated", c8, tok_s), 0.8, True),
        ("disagg c=1 tok/s / aggregated", ("disagg", c1, tok_s), ("aggregated", c1, tok_s), 0.8, True),
        ("disagg c=1 mean TTFT / aggregated", ("disagg", c1, ttft), ("aggregated", c1, ttft), 1.3, False),
        # the same throughput goals in CPU time per output token (2 cores: rate ~ 1 / CPU per token)
        ("CPU/token: HF generate / aggregated c=8", ("hf", c1, cpu), ("aggregated", c8, cpu), 4.0, True),
        ("CPU/token: disagg c=8 / aggregated c=8", ("disagg", c8, cpu), ("aggregated", c8, cpu), 1.25, False),
    ]
    out = []
    for name, num, den, goal, at_least in specs:
        a, b = _series(runs, *num), _series(runs, *den)
        if a is not None and b is not None:
            best = ratio(_best(a, num[2]), _best(b, den[2]))
            out.append(Comparison(name, _median(a), _median(b), goal, at_least,
                                  paired=_paired_median(a, b), best=best))
    return out


def _best(values: list[float], key: str) -> float:
    """The least disturbed run: the lowest latency or CPU cost (`*_ms*`), else the highest rate."""
    kept = [v for v in values if not math.isnan(v)]
    if not kept:
        return math.nan
    return min(kept) if "_ms" in key else max(kept)


def _median(values: list[float]) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return statistics.median(kept) if kept else math.nan


def environment() -> dict[str, str]:
    """Where and when: CPU model, cores, date, commit, library versions."""
    cpu = next((line.split(":", 1)[1].strip() for line in _lscpu().splitlines()
                if line.startswith("Model name")), platform.processor())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True, check=False).stdout.strip()
    return {"cpu": cpu, "cores": str(os.cpu_count()), "date": datetime.date.today().isoformat(),
            "commit": commit, "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "torch_threads": str(torch.get_num_threads())}


def _lscpu() -> str:
    try:
        return subprocess.run(["lscpu"], capture_output=True, text=True, check=False, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def print_tables(results: dict[str, dict[str, Summary]], found: list[Comparison]) -> None:
    rows = [(f"{part}: {name}", s) for part, figs in results.items() for name, s in figs.items()]
    print(figures_table(rows), "", comparisons_table(found), sep="\n", flush=True)


def report(record: dict, shared_concurrency: int = 8) -> list[Comparison]:
    """Tables and comparisons again from a saved `compare` record (its raw runs)."""
    runs: Runs = record["runs"]
    found = comparisons(runs, "random c=1", "random c=8", f"shared-prefix c={shared_concurrency}")
    print_tables(medians(runs), found)
    return found


def run_comparisons(model: str, wargs: WorkloadArgs, repeat: int, parts: Set[str],
                    agg_config: Path, disagg_config: Path, gate: QuietGate | None = None,
                    server_env: Mapping[str, str] | None = None) -> dict:
    """Start every requested server, measure all parts interleaved, print the tables, return the record."""
    unknown = set(parts) - {"hf", "agg", "noreuse", "disagg"}
    if unknown:
        raise ValueError(f"unknown parts {sorted(unknown)}; known: hf, agg, noreuse, disagg")
    vocab, env = model_vocab(model), dict(server_env or {})
    c1, c8 = random_figure(vocab, wargs, 1), random_figure(vocab, wargs, 8)
    shared = shared_prefix_figure(vocab, wargs, wargs.shared_concurrency)
    with ExitStack() as stack:
        plan: list[tuple[Target, list[Figure]]] = []
        if "hf" in parts:
            plan.append((hf_target(model, vocab), [c1]))
        if "agg" in parts:
            plan.append((start_server(stack, "aggregated", agg_config, True, vocab, env), [c1, c8, shared]))
        if "noreuse" in parts:
            plan.append((start_server(stack, "noreuse", agg_config, False, vocab, env), [shared, c8]))
        if "disagg" in parts:
            plan.append((start_server(stack, "disagg", disagg_config, True, vocab, env), [c1, c8]))
        runs = measure(plan, repeat, gate)
    found, results = comparisons(runs, c1.name, c8.name, shared.name), medians(runs)
    print_tables(results, found)
    return {"environment": environment(), "server_env": env, "model": model, "repeat": repeat, "figures": results,
            "comparisons": [c.as_dict() for c in found], "runs": runs}
