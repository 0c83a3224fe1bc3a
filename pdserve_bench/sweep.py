"""Serving sweep: TTFT, TPOT, ITL, E2E, output tok/s and goodput through the OpenAI streaming API.

    # aggregated vs disaggregated side by side, a concurrency sweep, repeats interleaved
    pdserve-bench sweep --deploy agg=configs/aggregated.yaml --deploy disagg=configs/disagg.yaml \\
        --workload random --concurrency 1 2 4 8 --repeat 3
    # prefix reuse on vs off (enable_block_reuse true / false) on the chat replay and shared prefixes
    pdserve-bench sweep --deploy agg=configs/aggregated.yaml --reuse both --workload multi-turn shared-prefix
    # the peers' length grid at 1/16 of its sizes, against a server that is already running
    pdserve-bench sweep --deploy live=http://127.0.0.1:8000 --workload grid --scale 1/16 --concurrency 4

A deployment is NAME=CONFIG.yaml (started here on free loopback ports, stopped at the end) or
NAME=URL (a running server or router). Every started deployment is up before anything is measured;
then repeat r of every figure of every deployment runs before repeat r+1, so that other load on
the machine hits all of them alike. Each figure's repeats draw fresh prompts (no cache hits across
repeats). One record per (deployment, reuse, figure) with per-metric medians over the repeats.
Progress on stderr, markdown tables on stdout.
"""

from __future__ import annotations

import argparse
import statistics
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve_bench import options
from pdserve_bench.launch import ServerUnderTest
from pdserve_bench.measure import (
    WORKLOADS,
    Figure,
    Runs,
    ServerTarget,
    figures_for,
    measure,
    medians,
    model_vocab,
    server_target,
)
from pdserve_bench.record import RecordWriter
from pdserve_bench.tables import figures_table

HELP = "workloads x concurrencies on one or more deployments, repeats interleaved"
REUSE = {"on": (True,), "off": (False,), "both": (True, False)}


@dataclass(frozen=True)
class Deployment:
    name: str
    source: str  # a deployment YAML, or the URL of a running server
    reuse: bool | None  # enable_block_reuse for a started one; None: a running server, as it is

    @property
    def is_url(self) -> bool:
        return self.source.startswith(("http://", "https://"))

    @property
    def label(self) -> str:
        return self.name if self.reuse in (True, None) else f"{self.name} reuse=off"


def parse_deployments(specs: list[str], reuse: str) -> list[Deployment]:
    """NAME=CONFIG or NAME=URL, each config once per reuse setting (`on`, `off` or `both`)."""
    out = []
    for spec in specs:
        name, sep, source = spec.partition("=")
        if not (name and sep and source):
            raise SystemExit(f"--deploy wants NAME=CONFIG.yaml or NAME=URL, got {spec!r}")
        if source.startswith(("http://", "https://")):
            out.append(Deployment(name, source.rstrip("/"), None))
        elif not Path(source).is_file():
            raise SystemExit(f"--deploy {spec}: no such file {source}")
        else:
            out += [Deployment(name, source, on) for on in REUSE[reuse]]
    labels = [d.label for d in out]
    if len(set(labels)) != len(labels):
        raise SystemExit(f"deployment names must differ, got {labels}")
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--deploy", action="append", required=True, metavar="NAME=CONFIG|URL",
                        help="a deployment YAML to start, or a running server's URL (repeatable)")
    parser.add_argument("--workload", nargs="+", choices=WORKLOADS, default=["random"])
    parser.add_argument("--reuse", choices=tuple(REUSE), default="on",
                        help="enable_block_reuse of the started deployments; both: each config twice")
    parser.add_argument("--profile", type=Path, metavar="DIR",
                        help="py-spy every started deployment into DIR/NAME.txt (see `profile`)")
    options.add_common(parser, repeat=5)
    options.add_serving(parser, concurrency=[1, 8])


def _start(stack: ExitStack, deployment: Deployment, args: argparse.Namespace, vocab: list[int]) -> ServerTarget:
    """The deployment's target, warmed up: started here (stopped when `stack` closes) or at its URL."""
    if deployment.is_url:
        return server_target(deployment.label, deployment.source, vocab)
    profile = None
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
        profile = args.profile / f"{deployment.label.replace(' ', '_').replace('=', '-')}.txt"
    server = ServerUnderTest(Path(deployment.source), reuse=bool(deployment.reuse), profile=profile,
                             env=options.server_env(args))
    url = stack.enter_context(server)
    return server_target(deployment.label, url, vocab, pid=server.pid)


def point_config(deployment: Deployment, figure: Figure, args: argparse.Namespace) -> dict[str, Any]:
    """What a record says it measured."""
    return {"deployment": deployment.name, "target": deployment.label, "source": deployment.source,
            "reuse": deployment.reuse, "workload": figure.workload_kind, "figure": figure.name,
            "concurrency": figure.concurrency, **figure.shape, "repeat": args.repeat,
            "slo": options.slo(args).as_dict(), "server_env": options.server_env(args)}


def write_records(out: RecordWriter, command: str, deployments: list[Deployment], figures: list[Figure],
                  runs: Runs, args: argparse.Namespace) -> None:
    found = medians(runs)
    for deployment in deployments:
        for figure in figures:
            repeats = runs[deployment.label][figure.name]
            out.write(command, point_config(deployment, figure, args), found[deployment.label][figure.name], repeats)


def ratio_table(runs: Runs, figure: str) -> str:
    """Per target: medians of TTFT mean / p50, TPOT p50 and tok/s of one figure, and ratios to the first."""
    keys = ("ttft_mean_ms", "ttft_p50_ms", "tpot_p50_ms", "output_tok_s")
    med = {name: {k: statistics.median(s[k] for s in figs[figure]) for k in keys}
           for name, figs in runs.items() if figure in figs}
    base = next(iter(med.values()))
    lines = [f"| {figure} | TTFT mean ms | ratio | TTFT p50 ms | ratio | TPOT p50 ms | ratio | out tok/s | ratio |",
             "|---" * 9 + "|"]
    for name, m in med.items():
        cells = [f"{m[k]:.2f} | {m[k] / base[k]:.2f}x" if base[k] else f"{m[k]:.2f} | -" for k in keys]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    out = options.writer(args)
    deployments = parse_deployments(args.deploy, args.reuse)
    vocab, wargs = model_vocab(args.model), options.workload_args(args)
    figures = [f for c in args.concurrency for kind in args.workload for f in figures_for(kind, vocab, wargs, c)]
    with ExitStack() as stack:
        plan = [(_start(stack, d, args, vocab), figures) for d in deployments]
        runs = measure(plan, args.repeat, options.quiet_gate(args), options.slo(args))
    found = medians(runs)
    print(figures_table([(f"{name}: {fig}", s) for name, figs in found.items() for fig, s in figs.items()]))
    if len(deployments) > 1:
        for figure in figures:
            print("", ratio_table(runs, figure.name), sep="\n")
    write_records(out, "sweep", deployments, figures, runs, args)
    if out.path is not None:
        print(f"\n{len(out.written)} records appended to {out.path}")
    return 0
