"""Figures of a serving benchmark: which workload at which concurrency, measured K times, medians.

A figure draws fresh prompts for every repeat (`seed_base + repeat`): a prompt repeated across
repeats would hit the previous repeat's prefix cache. Repeats of the figures of one server are
interleaved (repeat 0 of every figure, then repeat 1, ...) so that noise from other load on the
machine spreads evenly over them.
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from bench_client import bench, first_errors, served_model
from bench_launch import ServerUnderTest
from bench_stats import Summary, median_summary, summarize
from bench_workloads import (
    SharedPrefixShape,
    Workload,
    random_workload,
    shared_prefix_workload,
    usable_token_ids,
)
from transformers import AutoTokenizer

from server.models.builtin import resolve_model

WARMUP_SEED = 9  # figures draw from seeds >= 1_000_000


@dataclass(frozen=True)
class WorkloadArgs:
    num_prompts_c1: int = 8
    num_prompts_per_slot: int = 4  # at concurrency c > 1: c * this many prompts
    input_len: int = 256
    output_len: int = 64
    shared_concurrency: int = 8  # the shared-prefix figure of `compare`
    shape: SharedPrefixShape = SharedPrefixShape()


@dataclass(frozen=True)
class Figure:
    """One measured figure: a workload family at a concurrency; `seed_base + repeat` draws its prompts."""

    name: str
    make: Callable[[int], Workload]
    concurrency: int
    seed_base: int

    def workload(self, repeat: int) -> Workload:
        return self.make(self.seed_base + repeat)


def random_figure(vocab: list[int], args: WorkloadArgs, concurrency: int) -> Figure:
    count = args.num_prompts_c1 if concurrency == 1 else concurrency * args.num_prompts_per_slot
    make = lambda seed: random_workload(vocab, num_prompts=count, input_len=args.input_len,
                                        output_len=args.output_len, seed=seed)
    return Figure(f"random c={concurrency}", make, concurrency, seed_base=1_000_000 + 1_000 * concurrency)


def shared_prefix_figure(vocab: list[int], args: WorkloadArgs, concurrency: int) -> Figure:
    make = lambda seed: shared_prefix_workload(vocab, args.shape, seed=seed)
    name = f"shared-prefix c={concurrency}"
    return Figure(name, make, concurrency, seed_base=2_000_000 + 1_000 * concurrency)


def warm_up(url: str, model: str, vocab: list[int]) -> None:
    """A few short requests so that lazy initialisation is not timed."""
    workload = random_workload(vocab, num_prompts=4, input_len=64, output_len=8, seed=WARMUP_SEED)
    errors = first_errors(bench(url, model, workload, concurrency=2))
    if errors:
        raise RuntimeError(f"warm-up failed: {errors}")


def _own_cpu_s() -> float:
    """CPU seconds this benchmark process used so far: the client shares the cores with the server."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure(url: str, figures: Sequence[Figure], repeat: int, vocab: list[int]) -> dict[str, Summary]:
    """Median summary per figure name; repeats interleaved (r0 of every figure, then r1, ...)."""
    model = served_model(url)
    warm_up(url, model, vocab)
    runs: dict[str, list[Summary]] = {f.name: [] for f in figures}
    for r in range(repeat):
        for figure in figures:
            cpu_before = _own_cpu_s()
            results = bench(url, model, figure.workload(r), figure.concurrency)
            summary = summarize(results) | {"client_cpu_s": _own_cpu_s() - cpu_before}
            runs[figure.name].append(summary)
            errors = first_errors(results)
            print(f"  [{figure.name} run {r + 1}/{repeat}] {summary['output_tok_s']:.1f} tok/s, "
                  f"TTFT mean {summary['ttft_mean_ms']:.1f} ms" + (f", errors: {errors}" if errors else ""),
                  file=sys.stderr, flush=True)
    return {name: median_summary(found) for name, found in runs.items()}


def measure_server(config: Path | None, url: str | None, reuse: bool, figures: Sequence[Figure],
                   repeat: int, vocab: list[int], profile: Path | None = None) -> dict[str, Summary]:
    """`measure` against `url`, or against a server started from `config` (py-spy'd into `profile`)."""
    if url is not None:
        return measure(url, figures, repeat, vocab)
    if config is None:
        raise ValueError("give a url or a config")
    print(f"starting {config} (block reuse {'on' if reuse else 'off'})", file=sys.stderr, flush=True)
    with ServerUnderTest(config, reuse=reuse, profile=profile) as started:
        return measure(started, figures, repeat, vocab)


def model_vocab(model: str) -> list[int]:
    return usable_token_ids(AutoTokenizer.from_pretrained(resolve_model(model)))
