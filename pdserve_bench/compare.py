"""The goal comparisons of the engine and disaggregation issues, every baseline in the same run.

Parts (`--parts`); every requested server is started first (idle servers cost no CPU), then all
figures of all parts are measured `repeat` times, interleaved, and reduced to medians:
- hf:      transformers `generate`, one request at a time, on the c=1 random prompts;
- agg:     configs/aggregated.yaml, block reuse on: random c=1, random c=8, shared-prefix;
- noreuse: the same server binary and YAML with `enable_block_reuse: false`: shared-prefix, random c=8;
- disagg:  configs/disagg.yaml (router + context + generation): random c=1, random c=8.
Ratios use figures of this one run only.

    pdserve-bench compare --repeat 5 [--parts hf,agg,noreuse,disagg] [--server-env OMP_NUM_THREADS=1]

One record per (part, figure); `pdserve-bench report` rebuilds the comparisons from them.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Set
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedModel

from pdserve_bench import options
from pdserve_bench.cpu import QuietGate
from pdserve_bench.goals import comparisons
from pdserve_bench.hf_baseline import load_model, run_hf_baseline
from pdserve_bench.hf_baseline import warm_up as hf_warm_up
from pdserve_bench.launch import ServerUnderTest
from pdserve_bench.measure import (
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
from pdserve_bench.record import REPO
from pdserve_bench.stats import SLO, RequestResult, Summary
from pdserve_bench.tables import Comparison, comparisons_table, figures_table
from server.models.builtin import resolve_model

HELP = "every goal comparison of the engine and disaggregation issues, baselines in the same run"
PARTS = ("hf", "agg", "noreuse", "disagg")


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


def print_tables(results: dict[str, dict[str, Summary]], found: list[Comparison]) -> None:
    rows = [(f"{part}: {name}", s) for part, figs in results.items() for name, s in figs.items()]
    print(figures_table(rows), "", comparisons_table(found), sep="\n", flush=True)


def run_comparisons(model: str, wargs: WorkloadArgs, repeat: int, parts: Set[str],
                    agg_config: Path, disagg_config: Path, gate: QuietGate | None = None,
                    server_env: Mapping[str, str] | None = None,
                    slo: SLO | None = None) -> tuple[Runs, dict[str, list[Figure]]]:
    """Start every requested server, measure all parts interleaved, print the tables; the runs and
    which figures each target measured."""
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise ValueError(f"unknown parts {sorted(unknown)}; known: {', '.join(PARTS)}")
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
        runs = measure(plan, repeat, gate, slo)
    print_tables(medians(runs), comparisons(runs, c1.name, c8.name, shared.name))
    return runs, {target.name: figures for target, figures in plan}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--aggregated-config", type=Path, default=REPO / "configs/aggregated.yaml")
    parser.add_argument("--disagg-config", type=Path, default=REPO / "configs/disagg.yaml")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma list of: {', '.join(PARTS)}")
    options.add_common(parser, repeat=5)
    options.add_serving(parser, concurrency=None)


def run(args: argparse.Namespace) -> int:
    out = options.writer(args)
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    config = {"aggregated": args.aggregated_config, "noreuse": args.aggregated_config,
              "disagg": args.disagg_config, "hf": "transformers generate"}
    runs, plan = run_comparisons(args.model, options.workload_args(args), args.repeat, parts,
                                 args.aggregated_config, args.disagg_config, options.quiet_gate(args),
                                 options.server_env(args), options.slo(args))
    found = medians(runs)
    for target, figures in plan.items():
        for figure in figures:
            point = {"target": target, "deployment": target, "source": str(config[target]),
                     "reuse": {"hf": None, "noreuse": False}.get(target, True), "workload": figure.workload_kind,
                     "figure": figure.name, "concurrency": figure.concurrency, **figure.shape,
                     "repeat": args.repeat, "slo": options.slo(args).as_dict(), "model": args.model,
                     "server_env": options.server_env(args)}
            out.write("compare", point, found[target][figure.name], runs[target][figure.name])
    if out.path is not None:
        print(f"\n{len(out.written)} records appended to {out.path}", file=sys.stderr)
    return 0
