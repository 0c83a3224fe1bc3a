"""Serving benchmark: TTFT, TPOT, ITL, E2E and output tok/s through the OpenAI streaming API.

    # one workload against a running server, or against one started from a deployment YAML
    python scripts/bench_serving.py run --url http://127.0.0.1:8000 --workload random --concurrency 1 8
    python scripts/bench_serving.py run --config configs/aggregated.yaml --workload shared-prefix --no-reuse
    # every goal comparison of the engine and disaggregation issues, baselines in the same run
    python scripts/bench_serving.py compare --repeat 5 --json-out /tmp/bench.json
    # deployments side by side (all started, repeats interleaved); ratios to the first one
    python scripts/bench_serving.py ab --concurrency 1 --repeat 10 agg=configs/aggregated.yaml pair=configs/disagg.yaml

Each figure runs `--repeat` times with fresh prompts and reports per-metric medians (bench_measure).
Output: progress on stderr, markdown tables on stdout, then one JSON line (also `--json-out`).
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
from contextlib import ExitStack
from pathlib import Path

from bench_compare import report, run_comparisons
from bench_cpu import QuietGate
from bench_launch import REPO, ServerUnderTest
from bench_measure import (
    WorkloadArgs,
    measure,
    medians,
    model_vocab,
    random_figure,
    server_target,
    shared_prefix_figure,
)
from bench_report import figures_table
from bench_workloads import SharedPrefixShape


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="builtin:tiny-llama", help="for the vocabulary (and the baseline)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--num-prompts-c1", type=int, default=8)
    parser.add_argument("--num-prompts-per-slot", type=int, default=4, help="prompts = concurrency x this")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--shared-concurrency", type=int, default=8)
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--prompts-per-group", type=int, default=8)
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--question-len", type=int, default=32)
    parser.add_argument("--shared-output-len", type=int, default=32)
    parser.add_argument("--json-out", type=Path, help="also write the JSON line here")
    parser.add_argument("--quiet-max-busy", type=float, default=0.25,
                        help="before each figure run, wait until other work uses less than this share "
                             "of the CPUs (1 disables the wait)")
    parser.add_argument("--quiet-timeout", type=float, default=60.0, help="longest wait, seconds")
    parser.add_argument("--server-env", action="append", default=[], metavar="KEY=VALUE",
                        help="environment for the started servers only, e.g. OMP_NUM_THREADS=1 (repeatable)")


def workload_args(args: argparse.Namespace) -> WorkloadArgs:
    shape = SharedPrefixShape(args.groups, args.prompts_per_group, args.prefix_len, args.question_len,
                              args.shared_output_len)
    return WorkloadArgs(args.num_prompts_c1, args.num_prompts_per_slot, args.input_len, args.output_len,
                        args.shared_concurrency, shape)


def server_env(args: argparse.Namespace) -> dict[str, str]:
    pairs = [item.partition("=") for item in args.server_env]
    bad = [key for key, sep, _ in pairs if not sep or not key]
    if bad:
        raise SystemExit(f"--server-env wants KEY=VALUE, got {args.server_env}")
    return {key: value for key, _, value in pairs}


def quiet_gate(args: argparse.Namespace) -> QuietGate | None:
    return QuietGate(args.quiet_max_busy, args.quiet_timeout) if args.quiet_max_busy < 1 else None


def emit(record: dict, json_out: Path | None) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    if json_out is not None:
        json_out.write_text(line + "\n")


def cmd_run(args: argparse.Namespace) -> int:
    vocab, wargs = model_vocab(args.model), workload_args(args)
    make = random_figure if args.workload == "random" else shared_prefix_figure
    figures = [make(vocab, wargs, c) for c in args.concurrency]
    name = args.url or f"{args.config.name} reuse={'off' if args.no_reuse else 'on'}"
    with ExitStack() as stack:
        server = None if args.url else ServerUnderTest(args.config, reuse=not args.no_reuse,
                                                       profile=args.profile, env=server_env(args))
        url = args.url or stack.enter_context(server)
        target = server_target(name, url, vocab, pid=server.pid if server else None)
        runs = measure([(target, figures)], args.repeat, quiet_gate(args))
    found = medians(runs)[name]
    print(figures_table(list(found.items())))
    emit({"target": name, "repeat": args.repeat, "figures": found, "runs": runs[name]}, args.json_out)
    return 0


def cmd_ab(args: argparse.Namespace) -> int:
    """The same random figure on several deployments, interleaved; every ratio is to the first."""
    vocab, wargs = model_vocab(args.model), workload_args(args)
    figure = random_figure(vocab, wargs, args.concurrency)
    pairs = [spec.partition("=") for spec in args.deployments]
    if any(not name or not sep or not cfg for name, sep, cfg in pairs):
        raise SystemExit(f"deployments are NAME=CONFIG, got {args.deployments}")
    with ExitStack() as stack:
        plan = []
        for name, _, cfg in pairs:
            server = ServerUnderTest(Path(cfg), env=server_env(args))
            url = stack.enter_context(server)
            plan.append((server_target(name, url, vocab, pid=server.pid), [figure]))
        runs = measure(plan, args.repeat, quiet_gate(args))
    found = medians(runs)
    print(figures_table([(f"{name}: {figure.name}", figs[figure.name]) for name, figs in found.items()]))
    print(ab_table(runs, figure.name))
    emit({"figure": figure.name, "repeat": args.repeat, "figures": found, "runs": runs}, args.json_out)
    return 0


def ab_table(runs: dict, figure: str) -> str:
    """Per deployment: medians of the runs' mean TTFT, p50 TTFT and tok/s, and their ratio to the first."""
    keys = ("ttft_mean_ms", "ttft_p50_ms", "output_tok_s")
    med = {name: {k: statistics.median(s[k] for s in figs[figure]) for k in keys} for name, figs in runs.items()}
    base = next(iter(med.values()))
    lines = ["| deployment | TTFT mean ms | ratio | TTFT p50 ms | ratio | out tok/s | ratio |", "|---" * 7 + "|"]
    for name, m in med.items():
        cells = [f"{m[k]:.2f} | {m[k] / base[k]:.2f}x" for k in keys]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cmd_compare(args: argparse.Namespace) -> int:
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    record = run_comparisons(args.model, workload_args(args), args.repeat, parts, args.aggregated_config,
                             args.disagg_config, quiet_gate(args), server_env(args))
    emit(record, args.json_out)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    record = json.loads(args.record.read_text())
    print(json.dumps(record.get("environment", {})), f"server_env={record.get('server_env', {})}")
    report(record, args.shared_concurrency)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="one workload against one server")
    target = run.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="a running server or router, e.g. http://127.0.0.1:8000")
    target.add_argument("--config", type=Path, help="start this deployment YAML for the run")
    run.add_argument("--no-reuse", action="store_true", help="with --config: enable_block_reuse false")
    run.add_argument("--profile", type=Path, help="with --config: py-spy the server into this file")
    run.add_argument("--workload", choices=("random", "shared-prefix"), default="random")
    run.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    add_workload_args(run)
    run.set_defaults(func=cmd_run)
    ab = sub.add_parser("ab", help="one random figure on several deployments, interleaved")
    ab.add_argument("deployments", nargs="+", metavar="NAME=CONFIG")
    ab.add_argument("--concurrency", type=int, default=1)
    add_workload_args(ab)
    ab.set_defaults(func=cmd_ab)
    compare = sub.add_parser("compare", help="every goal comparison, baselines in the same run")
    compare.add_argument("--aggregated-config", type=Path, default=REPO / "configs/aggregated.yaml")
    compare.add_argument("--disagg-config", type=Path, default=REPO / "configs/disagg.yaml")
    compare.add_argument("--parts", default="hf,agg,noreuse,disagg",
                         help="comma list of: hf, agg, noreuse, disagg")
    add_workload_args(compare)
    compare.set_defaults(func=cmd_compare)
    again = sub.add_parser("report", help="the tables again from a `compare --json-out` file")
    again.add_argument("record", type=Path)
    again.add_argument("--shared-concurrency", type=int, default=8)
    again.set_defaults(func=cmd_report)
    return parser


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds the ExitStack: every started server is stopped


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # a shell's background job starts with SIGINT ignored; both signals must stop the servers we started
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _exit_on_signal)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
