"""Where a request's time goes under load: per-request start, TTFT, first-to-second-token gap, end.

    python scripts/bench_timeline.py configs/disagg.yaml [--concurrency 8] [--requests 32] [--repeat 3]

Starts the deployment, warms it up, then runs `--repeat` rounds of `--requests` random prompts
(256 in, 64 out, fresh seed per round) with `--concurrency` in flight. Prints per round the output
tok/s and the means of E2E, TTFT, the gap between the first and second streamed token (for a
disaggregated pair: the generation leg, admission and KV pull) and the time per later chunk;
then the first 16 requests of the last round, in start order, in ms from the round's start (with
equal output lengths, requests that start together finish together: the rounds run in waves).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from bench_client import bench, served_model
from bench_launch import ServerUnderTest
from bench_measure import model_vocab
from bench_stats import RequestResult
from bench_workloads import random_workload


def _ms(seconds: float) -> float:
    return 1e3 * seconds


def round_line(name: str, index: int, results: list[RequestResult], output_len: int) -> str:
    span = max(r.end for r in results) - min(r.start for r in results)
    ttft = [_ms(r.first_token - r.start) for r in results]
    gap = [_ms(r.chunk_times[1] - r.chunk_times[0]) for r in results if len(r.chunk_times) > 1]
    later = [_ms(r.chunk_times[-1] - r.chunk_times[1]) / (len(r.chunk_times) - 2)
             for r in results if len(r.chunk_times) > 2]
    e2e = [_ms(r.end - r.start) for r in results]
    return (f"{name} round {index}: {len(results) * output_len / span:.0f} tok/s, E2E {statistics.mean(e2e):.1f}, "
            f"TTFT {statistics.mean(ttft):.1f}, first->second {statistics.mean(gap):.1f}, "
            f"per later chunk {statistics.mean(later):.2f} ms")


def request_lines(results: list[RequestResult], t0: float, count: int = 16) -> list[str]:
    lines = []
    for r in sorted(results, key=lambda r: r.start)[:count]:
        second = _ms(r.chunk_times[1] - r.first_token) if len(r.chunk_times) > 1 else float("nan")
        lines.append(f"  start {_ms(r.start - t0):7.1f}  TTFT {_ms(r.first_token - r.start):6.1f}  "
                     f"2nd +{second:5.1f}  end {_ms(r.end - t0):7.1f}  chunks {len(r.chunk_times)}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", type=Path)
    parser.add_argument("--model", default="builtin:tiny-llama")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()
    vocab = model_vocab(args.model)
    workload = lambda seed, n: random_workload(vocab, num_prompts=n, input_len=args.input_len,
                                               output_len=args.output_len, seed=seed)
    with ServerUnderTest(args.config) as url:
        model = served_model(url)
        bench(url, model, workload(1, 2 * args.concurrency), args.concurrency)  # warm-up
        for index in range(args.repeat):
            t0 = time.perf_counter()
            results = bench(url, model, workload(100 + index, args.requests), args.concurrency)
            errors = [r.error for r in results if r.error]
            if errors:
                raise SystemExit(f"requests failed: {errors[:3]}")
            print(round_line(args.config.name, index, results, args.output_len), flush=True)
        print("\n".join(request_lines(results, t0)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
