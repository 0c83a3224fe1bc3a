"""Flags every subcommand shares, and the ones every serving subcommand shares."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pdserve_bench.cpu import QuietGate
from pdserve_bench.measure import WorkloadArgs
from pdserve_bench.record import RecordWriter, RunContext
from pdserve_bench.stats import SLO
from pdserve_bench.workloads import MultiTurnShape, SharedPrefixShape, parse_scale

DEFAULT_OUT = Path("bench-results")


def add_common(parser: argparse.ArgumentParser, *, repeat: int | None, model: bool = True) -> None:
    """--out, --no-record, --repeat (with this command's default) and --model."""
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"records.jsonl in this folder gets one JSON line per measured point "
                             f"(default {DEFAULT_OUT})")
    parser.add_argument("--no-record", action="store_true", help="print only, write no record")
    if repeat is not None:
        parser.add_argument("--repeat", type=int, default=repeat, help=f"repeats per figure (default {repeat})")
    if model:
        parser.add_argument("--model", default="builtin:tiny-llama",
                            help="model for the vocabulary of the prompts (and any in-process baseline)")


def writer(args: argparse.Namespace) -> RecordWriter:
    """The record writer of this invocation (machine, commit and command line captured once)."""
    context = RunContext.capture(["pdserve-bench", *sys.argv[1:]])
    return RecordWriter(None if args.no_record else args.out, context)


def add_lengths(parser) -> None:
    """--input-len / --output-len of a random workload (a parser or an argument group)."""
    parser.add_argument("--input-len", type=int, default=256, help="random workload: prompt tokens")
    parser.add_argument("--output-len", type=int, default=64, help="random workload: tokens to generate")


def add_serving(parser: argparse.ArgumentParser, *, concurrency: list[int] | None) -> None:
    """Workload shapes, SLO, quiet-machine gate and server environment of the serving benchmarks."""
    if concurrency is not None:
        parser.add_argument("--concurrency", type=int, nargs="+", default=concurrency,
                            help=f"requests in flight, one figure each (default {' '.join(map(str, concurrency))})")
    group = parser.add_argument_group("workloads")
    group.add_argument("--num-prompts-c1", type=int, default=8, help="prompts of a figure at concurrency 1")
    group.add_argument("--num-prompts-per-slot", type=int, default=4, help="at concurrency c > 1: c x this")
    add_lengths(group)
    group.add_argument("--shared-concurrency", type=int, default=8, help="compare's shared-prefix figure")
    group.add_argument("--groups", type=int, default=16, help="shared-prefix")
    group.add_argument("--prompts-per-group", type=int, default=8, help="shared-prefix")
    group.add_argument("--prefix-len", type=int, default=512, help="shared-prefix")
    group.add_argument("--question-len", type=int, default=32, help="shared-prefix")
    group.add_argument("--shared-output-len", type=int, default=32, help="shared-prefix")
    group.add_argument("--conversations", type=int, default=8, help="multi-turn")
    group.add_argument("--turns", type=int, default=4, help="multi-turn")
    group.add_argument("--user-len", type=int, default=128, help="multi-turn: new user tokens per turn")
    group.add_argument("--turn-output-len", type=int, default=32, help="multi-turn: tokens per answer")
    group.add_argument("--scale", default="1", help="grid: lengths times this, e.g. 1/16 on a CPU (default 1)")
    add_slo(parser)
    machine = parser.add_argument_group("machine")
    machine.add_argument("--quiet-max-busy", type=float, default=0.25,
                         help="before each figure run, wait until other work uses less than this share "
                              "of the CPUs (1 disables the wait)")
    machine.add_argument("--quiet-timeout", type=float, default=60.0, help="longest wait, seconds")
    add_server_env(machine)


def add_slo(parser: argparse.ArgumentParser) -> None:
    """--slo-ttft-ms / --slo-tpot-ms: the latency target goodput counts within."""
    slo = parser.add_argument_group("goodput SLO")
    slo.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="TTFT target (default 2000)")
    slo.add_argument("--slo-tpot-ms", type=float, default=50.0, help="TPOT target (default 50)")


def add_server_env(parser) -> None:
    """--server-env KEY=VALUE (a parser or an argument group)."""
    parser.add_argument("--server-env", action="append", default=[], metavar="KEY=VALUE",
                        help="environment for the started servers only, e.g. OMP_NUM_THREADS=1 (repeatable)")


def workload_args(args: argparse.Namespace) -> WorkloadArgs:
    shape = SharedPrefixShape(args.groups, args.prompts_per_group, args.prefix_len, args.question_len,
                              args.shared_output_len)
    chat = MultiTurnShape(args.conversations, args.turns, args.user_len, args.turn_output_len)
    try:
        scale = parse_scale(args.scale)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    return WorkloadArgs(args.num_prompts_c1, args.num_prompts_per_slot, args.input_len, args.output_len,
                        args.shared_concurrency, shape, chat, scale)


def slo(args: argparse.Namespace) -> SLO:
    return SLO(args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)


def server_env(args: argparse.Namespace) -> dict[str, str]:
    pairs = [item.partition("=") for item in args.server_env]
    bad = [key for key, sep, _ in pairs if not sep or not key]
    if bad:
        raise SystemExit(f"--server-env wants KEY=VALUE, got {args.server_env}")
    return {key: value for key, _, value in pairs}


def quiet_gate(args: argparse.Namespace) -> QuietGate | None:
    return QuietGate(args.quiet_max_busy, args.quiet_timeout) if args.quiet_max_busy < 1 else None
