"""Where a request's time goes under load: per-request start, TTFT, first-to-second-token gap, end.

    pdserve-bench timeline configs/disagg.yaml [--concurrency 8] [--requests 32] [--repeat 3]

Starts the deployment, warms it up, then runs `--repeat` rounds of `--requests` random prompts
(256 in, 64 out, fresh seed per round) with `--concurrency` in flight. Prints per round the output
tok/s and the means of E2E, TTFT, the gap between the first and second streamed token (for a
disaggregated pair: the generation leg, admission and KV pull) and the time per later chunk;
then the first 16 requests of the last round, in start order, in ms from the round's start (with
equal output lengths, requests that start together finish together: the rounds run in waves).
One record: the summary's medians over the rounds, plus the mean first->second gap and later chunk.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from pdserve_bench import options
from pdserve_bench.client import bench, served_model
from pdserve_bench.launch import ServerUnderTest
from pdserve_bench.measure import model_vocab
from pdserve_bench.stats import RequestResult, Summary, median_summary, summarize
from pdserve_bench.workloads import random_workload

HELP = "per-request start, TTFT, first-to-second-token gap and end under load, round by round"


def _ms(seconds: float) -> float:
    return 1e3 * seconds


def round_figures(results: list[RequestResult]) -> Summary:
    """The round's summary plus the mean first->second chunk gap and mean time per later chunk."""
    gap = [_ms(r.chunk_times[1] - r.chunk_times[0]) for r in results if len(r.chunk_times) > 1]
    later = [_ms(r.chunk_times[-1] - r.chunk_times[1]) / (len(r.chunk_times) - 2)
             for r in results if len(r.chunk_times) > 2]
    mean = lambda xs: statistics.mean(xs) if xs else float("nan")
    return summarize(results) | {"first_to_second_mean_ms": mean(gap), "later_chunk_mean_ms": mean(later)}


def round_line(name: str, index: int, figures: Summary) -> str:
    return (f"{name} round {index}: {figures['output_tok_s']:.0f} tok/s, E2E {figures['e2e_mean_ms']:.1f}, "
            f"TTFT {figures['ttft_mean_ms']:.1f}, first->second {figures['first_to_second_mean_ms']:.1f}, "
            f"per later chunk {figures['later_chunk_mean_ms']:.2f} ms")


def request_lines(results: list[RequestResult], t0: float, count: int = 16) -> list[str]:
    lines = []
    for r in sorted(results, key=lambda r: r.start)[:count]:
        second = _ms(r.chunk_times[1] - r.first_token) if len(r.chunk_times) > 1 else float("nan")
        lines.append(f"  start {_ms(r.start - t0):7.1f}  TTFT {_ms(r.first_token - r.start):6.1f}  "
                     f"2nd +{second:5.1f}  end {_ms(r.end - t0):7.1f}  chunks {len(r.chunk_times)}")
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", type=Path, help="deployment YAML to start")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--requests", type=int, default=32, help="per round")
    options.add_lengths(parser)
    options.add_common(parser, repeat=3)


def run(args: argparse.Namespace) -> int:
    out = options.writer(args)
    vocab = model_vocab(args.model)
    workload = lambda seed, n: random_workload(vocab, num_prompts=n, input_len=args.input_len,
                                               output_len=args.output_len, seed=seed)
    rounds = []
    with ServerUnderTest(args.config) as url:
        model = served_model(url)
        bench(url, model, workload(1, 2 * args.concurrency), args.concurrency)  # warm-up
        for index in range(args.repeat):
            t0 = time.perf_counter()
            results = bench(url, model, workload(100 + index, args.requests), args.concurrency)
            errors = [r.error for r in results if r.error]
            if errors:
                raise SystemExit(f"requests failed: {errors[:3]}")
            rounds.append(round_figures(results))
            print(round_line(args.config.name, index, rounds[-1]), flush=True)
        print("\n".join(request_lines(results, t0)))
    config = {"deployment": args.config.stem, "source": str(args.config), "workload": "random",
              "concurrency": args.concurrency, "num_prompts": args.requests, "input_len": args.input_len,
              "output_len": args.output_len, "repeat": args.repeat}
    out.write("timeline", config, median_summary(rounds), rounds)
    return 0
