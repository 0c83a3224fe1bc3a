"""Load: streams from several client processes, closed or open loop, per-second time series per run.

    # closed loop: 32 streams started over 5 s, for 60 s, on a fresh aggregated server (no warm-up)
    pdserve-bench load --deploy agg=configs/aggregated.yaml --concurrency 32 --ramp-s 5 --duration 60 --no-warmup
    # open loop: Poisson arrivals at 4 requests/s (seeded), 200 requests, against a running router
    pdserve-bench load --deploy live=http://127.0.0.1:8000 --rate 4 --num-requests 200
    # prefill interference: 128/256 streams at c=16 while 1,536/256 prompts arrive at 0.5/s
    # (the shipped configs hold 2,048 tokens per sequence; the GPU script's servers hold 8,192)
    pdserve-bench load --deploy agg=configs/aggregated.yaml --deploy disagg=configs/disagg.yaml \\
        --workload mixed --concurrency 16 --input-len 128 --output-len 256 --long-input-len 1536 \\
        --long-rate 0.5 --duration 60 --repeat 3

The client runs in `--client-procs` worker processes (default min(8, cores)), each an asyncio
streaming client (aiohttp); their timings come back as JSON lines. Closed loop (`--concurrency C`):
C streams, each sending its next request when the last one ends, stream k starting at
`ramp_s * k / C`. Open loop (`--rate R`): Poisson arrivals, seeded, the rate ramping up linearly over
`--ramp-s`. Requests start until `--duration` seconds have passed or `--num-requests` were sent.
`--workload mixed` adds open-loop long prompts (`--long-*`) to the main traffic (then called
`background`) and reports each class apart (`background_tpot_p99_ms`, `long_ttft_p50_ms`, ...).

Per run: TTFT / TPOT / ITL / E2E p50, p90, p99, output tok/s, requests/s, goodput within the SLO,
errors; `steady_output_tok_s`, the output tokens that arrived between the ramp's end and the
duration's end per second (every stream running, none drained yet); the mean TTFT of the requests
started in the first `--window-s` seconds against the later ones; the servers' own mean TTFT, queue
time, TPOT and E2E from their /metrics (scraped before and after; `server_` = the servers that
answer the first token, `generation_` = a pair's generation servers; a router's /metrics has none
of them); where the time to first token went, phase by phase (`phase_NAME_mean_ms`, `_p50_ms`,
`_count`: router queue, context queue, prefill, context leg, handoff, generation queue, KV transfer,
first event; from the router's and the servers' histograms, docs/DISAGG_LOAD.md); the busiest
client process's share of a core (`client_busiest_core_share`: near 1, the client may have set the
pace); a per-second series (requests started, mean TTFT, output tok/s, errors). Runs of several
deployments are interleaved (repeat r of each before r+1). One record per deployment: medians over
the repeats, each repeat, and each repeat's series (`report` plots them).
"""

from __future__ import annotations

import argparse
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from pdserve_bench import options
from pdserve_bench.launch import ServerUnderTest
from pdserve_bench.load_client import LoadPlan, default_procs
from pdserve_bench.load_job import Traffic
from pdserve_bench.load_report import load_table, phase_table, run_line
from pdserve_bench.load_target import LoadTarget, measure_run, started_target, url_target
from pdserve_bench.measure import model_vocab, warm_up
from pdserve_bench.stats import median_summary
from pdserve_bench.sweep import Deployment, parse_deployments
from pdserve_bench.tables import percentile_table

HELP = "closed- or open-loop load from several client processes; mixed prefill interference; time series"
LONG_SEED_OFFSET = 500_000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--deploy", action="append", required=True, metavar="NAME=CONFIG|URL",
                        help="a deployment YAML to start, or a running server's URL (repeatable)")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--concurrency", type=int, help="closed loop: streams in flight")
    mode.add_argument("--rate", type=float, help="open loop: Poisson arrivals, requests/s")
    parser.add_argument("--duration", type=float, help="seconds during which requests start")
    parser.add_argument("--num-requests", type=int, help="at most this many requests (of the main traffic)")
    parser.add_argument("--ramp-s", type=float, default=0.0, help="staggered start: streams (or the rate) ramp "
                                                                  "up over this many seconds (default 0)")
    parser.add_argument("--workload", choices=("random", "mixed"), default="random")
    options.add_lengths(parser)
    mixed = parser.add_argument_group("mixed workload: long prompts arriving while the main traffic decodes")
    mixed.add_argument("--long-input-len", type=int, default=2048)
    mixed.add_argument("--long-output-len", type=int, default=256)
    mixed.add_argument("--long-rate", type=float, default=0.5, help="long prompts per second (Poisson)")
    mixed.add_argument("--long-requests", type=int, help="at most this many long prompts")
    parser.add_argument("--client-procs", type=int, default=default_procs(),
                        help=f"client worker processes (default min(8, cores) = {default_procs()})")
    parser.add_argument("--seed", type=int, default=0, help="prompts and arrivals (each repeat adds 1)")
    parser.add_argument("--window-s", type=float, default=60.0, help="first window of the run (default 60 s)")
    parser.add_argument("--bin-s", type=float, default=1.0, help="time-series bin (default 1 s)")
    parser.add_argument("--no-warmup", action="store_true", help="measure a started server from its first request")
    parser.add_argument("--no-metrics", action="store_true", help="do not scrape the servers' /metrics")
    parser.add_argument("--scrape", action="append", default=[], metavar="[generation=|router=]URL",
                        help="for deployments given by URL: a server whose /metrics to read instead of that URL "
                             "(e.g. a router's context server; generation=URL for a generation server, "
                             "router=URL for the router)")
    options.add_common(parser, repeat=1)
    options.add_slo(parser)
    options.add_server_env(parser)


def load_plan(args: argparse.Namespace, repeat: int) -> LoadPlan:
    """The run of repeat `repeat`: fresh prompts and arrivals per repeat (no cache hits across them)."""
    seed = args.seed * 1_000 + repeat
    main = Traffic("background" if args.workload == "mixed" else "main", args.input_len, args.output_len,
                   concurrency=args.concurrency or 0, rate=args.rate or 0.0, count=args.num_requests, seed=seed)
    traffic = [main]
    if args.workload == "mixed":
        traffic.append(Traffic("long", args.long_input_len, args.long_output_len, rate=args.long_rate,
                               count=args.long_requests, seed=seed + LONG_SEED_OFFSET))
    try:
        return LoadPlan(tuple(traffic), args.duration, args.ramp_s)
    except ValueError as exc:
        raise SystemExit(f"pdserve-bench load: {exc}") from None


def figure_name(plan: LoadPlan) -> str:
    """`c=32`, `rate=4/s`, `c=16 + 2048in@0.5/s`."""
    first, *rest = plan.traffic
    parts = [f"c={first.concurrency}" if first.closed else f"rate={first.rate:g}/s"]
    parts += [f"{t.input_len}in c={t.concurrency}" if t.closed else f"{t.input_len}in@{t.rate:g}/s" for t in rest]
    return " + ".join(parts)


def _start(stack: ExitStack, deployment: Deployment, args: argparse.Namespace, vocab: list[int]) -> LoadTarget:
    if deployment.is_url:
        target = url_target(deployment.label, deployment.source, scrape_list(args.scrape))
    else:
        server = ServerUnderTest(Path(deployment.source), env=options.server_env(args))
        stack.enter_context(server)
        target = started_target(deployment.label, server)
    if not args.no_warmup:
        warm_up(target.url, target.model, vocab)
    return target


def scrape_list(specs: list[str]) -> tuple[tuple[str, str], ...]:
    """--scrape values as (role, URL): `URL` answers first tokens (`server_*`), `generation=URL` not,
    `router=URL` is the router (its phases)."""
    out = []
    for spec in specs:
        role, sep, url = spec.partition("=")
        if not sep:
            role, url = "server", spec
        if role not in ("server", "generation", "router") or not url.startswith(("http://", "https://")):
            raise SystemExit(f"--scrape wants URL, generation=URL or router=URL, got {spec!r}")
        out.append((role, url.rstrip("/")))
    return tuple(out)


def point_config(deployment: Deployment, plan: LoadPlan, args: argparse.Namespace) -> dict[str, Any]:
    main = plan.traffic[0]
    config = {"deployment": deployment.name, "target": deployment.label, "source": deployment.source,
              "workload": args.workload, "figure": figure_name(plan), "concurrency": main.concurrency,
              "rate": main.rate, "input_len": main.input_len, "output_len": main.output_len,
              "duration_s": plan.duration_s, "num_requests": main.count, "ramp_s": plan.ramp_s,
              "client_procs": args.client_procs, "window_s": args.window_s, "bin_s": args.bin_s,
              "warmup": not args.no_warmup, "repeat": args.repeat, "slo": options.slo(args).as_dict(),
              "server_env": options.server_env(args)}
    if args.workload == "mixed":
        long = plan.traffic[1]
        config |= {"long_input_len": long.input_len, "long_output_len": long.output_len, "long_rate": long.rate,
                   "long_requests": long.count}
    return config


def run(args: argparse.Namespace) -> int:
    out = options.writer(args)
    deployments = parse_deployments(args.deploy, "on")
    vocab = model_vocab(args.model)
    plans = [load_plan(args, r) for r in range(args.repeat)]
    runs: dict[str, list] = {d.label: [] for d in deployments}
    with ExitStack() as stack:
        targets = [_start(stack, d, args, vocab) for d in deployments]
        for r, plan in enumerate(plans):
            for target in targets:
                found = measure_run(target, plan, vocab, args.client_procs, options.slo(args), args.window_s,
                                    args.bin_s, scrape_metrics=not args.no_metrics)
                runs[target.name].append(found)
                print(run_line(target.name, r, args.repeat, found[0]), file=sys.stderr, flush=True)
    rows = []
    for deployment, target in zip(deployments, targets, strict=True):
        summaries, series = [s for s, _ in runs[target.name]], [c for _, c in runs[target.name]]
        figures = median_summary(summaries) | {"startup_s": target.startup_s}
        out.write("load", point_config(deployment, plans[0], args), figures, summaries, series)
        rows.append((f"{target.name}: {figure_name(plans[0])}", figures))
    print(percentile_table(rows), "", load_table(rows), "", phase_table(rows), sep="\n")
    if out.path is not None:
        print(f"\n{len(out.written)} records appended to {out.path}")
    return 0
