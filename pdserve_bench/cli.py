"""`pdserve-bench SUBCOMMAND ...`: every benchmark and long run of the project, one record format,
one report.

Measuring subcommands share --out (records.jsonl goes there), --repeat and --model; the serving
ones also share the workload, SLO and machine flags. `report` turns records into markdown + PNGs.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys

# subcommand -> (module with add_arguments(parser) and run(args) -> exit status, one-line help).
# Only the chosen subcommand's module is imported: most of them import torch, `report` does not.
COMMANDS = {
    "sweep": ("pdserve_bench.sweep", "workloads x concurrencies on one or more deployments, repeats interleaved"),
    "load": ("pdserve_bench.load", "closed- or open-loop load from several client processes, mixed "
                                   "prefill interference, per-second series"),
    "compare": ("pdserve_bench.compare", "every goal comparison of the engine and disaggregation issues"),
    "report": ("pdserve_bench.report", "records (JSON lines) -> markdown tables and PNG plots"),
    "timeline": ("pdserve_bench.timeline", "per-request start, TTFT, second token and end under load"),
    "hf": ("pdserve_bench.hf_baseline", "baseline: transformers generate, one request at a time"),
    "runner-step": ("pdserve_bench.runner_step", "one engine step of 8 decode tokens vs one HF decode step"),
    "kvcache": ("pdserve_bench.kvcache_bench", "KV cache manager overhead; offload/onboard vs a plain copy"),
    "transfer": ("pdserve_bench.transfer_bench", "KV transfer throughput: the transceiver vs raw pyzmq"),
    "router": ("pdserve_bench.router_bench", "router overhead to the first SSE event vs the backend alone"),
    "gpu-handoff": ("pdserve_bench.gpu_handoff", "KV handoff on one GPU, 8B-shaped model, 4,096-token prompt"),
    "profile": ("pdserve_bench.profile_stacks", "summarize py-spy stacks of a profiled sweep (no record)"),
    "soak": ("pdserve_bench.soak", "many streams for minutes under KV pool pressure, answers checked"),
    "fuzz": ("pdserve_bench.fuzz", "schemathesis against the router and both servers of a deployment"),
}


def build_parser(chosen: str | None = None) -> argparse.ArgumentParser:
    """Every subcommand; the arguments of `chosen` only (None: all of them, importing every module)."""
    parser = argparse.ArgumentParser(prog="pdserve-bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="SUBCOMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        if chosen is not None and name != chosen:
            sub.add_parser(name, help=help_text)
            continue
        module = importlib.import_module(module_name)
        command = sub.add_parser(name, help=help_text, description=module.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(command)
        command.set_defaults(func=module.run)
    return parser


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds every ExitStack: each started server is stopped


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    chosen = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(chosen if chosen in COMMANDS else "report").parse_args(argv)
    # a shell's background job starts with SIGINT ignored; both signals must stop the servers we started
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _exit_on_signal)
    return args.func(args)
