"""Figures of a serving benchmark: which workload at which concurrency, on which target, K times.

A figure draws fresh prompts for every repeat (`seed_base + repeat`): a prompt repeated across
repeats would hit the previous repeat's prefix cache. `measure` interleaves the repeats of every
figure of every target, so that noise from other load on the machine spreads evenly over them.
Workload kinds: `random`, `shared-prefix`, `multi-turn` (chat replay) and `grid` (the peers'
input/output lengths times `scale`, one figure per grid point).
"""

from __future__ import annotations

import math
import os
import resource
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from typing import Any, Protocol

from transformers import AutoTokenizer

from pdserve_bench.client import bench, first_errors, served_model
from pdserve_bench.cpu import QuietGate, tree_cpu_s
from pdserve_bench.stats import SLO, RequestResult, Summary, median_summary, summarize
from pdserve_bench.workloads import (
    MultiTurnShape,
    SharedPrefixShape,
    Workload,
    length_grid,
    multi_turn_workload,
    random_workload,
    shared_prefix_workload,
    usable_token_ids,
)
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
    multi_turn: MultiTurnShape = MultiTurnShape()
    scale: Fraction = Fraction(1)  # of the length grid's sizes


@dataclass(frozen=True)
class Figure:
    """One measured figure: a workload family at a concurrency; `seed_base + repeat` draws its prompts."""

    name: str
    make: Callable[[int], Workload]
    concurrency: int
    seed_base: int
    workload_kind: str = "random"
    shape: dict[str, Any] = field(default_factory=dict)  # what the record's config says of the workload

    def workload(self, repeat: int) -> Workload:
        return self.make(self.seed_base + repeat)


def _count(args: WorkloadArgs, concurrency: int) -> int:
    return args.num_prompts_c1 if concurrency == 1 else concurrency * args.num_prompts_per_slot


def random_figure(vocab: list[int], args: WorkloadArgs, concurrency: int) -> Figure:
    count = _count(args, concurrency)
    make = lambda seed: random_workload(vocab, num_prompts=count, input_len=args.input_len,
                                        output_len=args.output_len, seed=seed)
    shape = {"num_prompts": count, "input_len": args.input_len, "output_len": args.output_len}
    return Figure(f"random c={concurrency}", make, concurrency, 1_000_000 + 1_000 * concurrency, "random", shape)


def shared_prefix_figure(vocab: list[int], args: WorkloadArgs, concurrency: int) -> Figure:
    make = lambda seed: shared_prefix_workload(vocab, args.shape, seed=seed)
    name = f"shared-prefix c={concurrency}"
    return Figure(name, make, concurrency, 2_000_000 + 1_000 * concurrency, "shared-prefix", asdict(args.shape))


def multi_turn_figure(vocab: list[int], args: WorkloadArgs, concurrency: int) -> Figure:
    make = lambda seed: multi_turn_workload(vocab, args.multi_turn, seed=seed)
    name = f"multi-turn c={concurrency}"
    return Figure(name, make, concurrency, 3_000_000 + 1_000 * concurrency, "multi-turn", asdict(args.multi_turn))


def grid_figures(vocab: list[int], args: WorkloadArgs, concurrency: int) -> list[Figure]:
    """One random figure per point of the length grid, both lengths times `args.scale`."""
    count = _count(args, concurrency)
    figures = []
    for index, point in enumerate(length_grid(args.scale)):
        make = lambda seed, p=point: random_workload(vocab, num_prompts=count, input_len=p.input_len,
                                                     output_len=p.output_len, seed=seed)
        shape = {"grid_point": point.label, "scale": str(args.scale), "num_prompts": count,
                 "input_len": point.input_len, "output_len": point.output_len}
        seed_base = 4_000_000 + 100_000 * index + 1_000 * concurrency
        figures.append(Figure(f"grid {point.label} c={concurrency}", make, concurrency, seed_base, "grid", shape))
    return figures


WORKLOADS = ("random", "shared-prefix", "multi-turn", "grid")


def figures_for(kind: str, vocab: list[int], args: WorkloadArgs, concurrency: int) -> list[Figure]:
    if kind == "random":
        return [random_figure(vocab, args, concurrency)]
    if kind == "shared-prefix":
        return [shared_prefix_figure(vocab, args, concurrency)]
    if kind == "multi-turn":
        return [multi_turn_figure(vocab, args, concurrency)]
    if kind == "grid":
        return grid_figures(vocab, args, concurrency)
    raise ValueError(f"unknown workload {kind!r}; known: {', '.join(WORKLOADS)}")


def warm_up(url: str, model: str, vocab: list[int]) -> None:
    """A few short requests so that lazy initialisation is not timed."""
    workload = random_workload(vocab, num_prompts=4, input_len=64, output_len=8, seed=WARMUP_SEED)
    errors = first_errors(bench(url, model, workload, concurrency=2))
    if errors:
        raise RuntimeError(f"warm-up failed: {errors}")


def own_cpu_s() -> float:
    """CPU seconds this benchmark process used so far: the client shares the cores with the server."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class Target(Protocol):
    """Something that serves a figure's requests: a server URL, or the HF baseline in this process."""

    name: str

    def run(self, figure: Figure, repeat: int) -> list[RequestResult]: ...

    def cpu_s(self) -> float:
        """CPU seconds the serving side has used so far (NaN when unknown)."""
        ...


@dataclass(frozen=True)
class ServerTarget:
    name: str
    url: str
    model: str  # as GET /v1/models names it
    pid: int | None = None  # the server (or launcher) process, when we started it: its CPU is measured

    def cpu_s(self) -> float:
        return tree_cpu_s(self.pid) if self.pid is not None else math.nan

    def run(self, figure: Figure, repeat: int) -> list[RequestResult]:
        return bench(self.url, self.model, figure.workload(repeat), figure.concurrency)


def server_target(name: str, url: str, vocab: list[int], pid: int | None = None) -> ServerTarget:
    """The server at `url`, warmed up."""
    target = ServerTarget(name, url, served_model(url), pid)
    warm_up(url, target.model, vocab)
    return target


Runs = dict[str, dict[str, list[Summary]]]  # target name -> figure name -> one summary per repeat


def _measure_once(target: Target, figure: Figure, repeat: int, of: int, gate: QuietGate | None,
                  slo: SLO | None) -> Summary:
    busy_before = gate.wait() if gate is not None else math.nan
    cpu_before, server_before = own_cpu_s(), target.cpu_s()
    results = target.run(figure, repeat)
    server_cpu = target.cpu_s() - server_before
    summary = summarize(results, slo)
    summary |= {"client_cpu_s": own_cpu_s() - cpu_before, "busy_before": busy_before,
                "server_cpu_ms_per_token": 1e3 * server_cpu / max(summary["output_tokens"], 1.0),
                "load_1m": os.getloadavg()[0]}  # other work on the machine shows here
    errors = first_errors(results)
    print(f"  [{target.name}: {figure.name} run {repeat + 1}/{of}] {summary['output_tok_s']:.1f} tok/s, "
          f"TTFT mean {summary['ttft_mean_ms']:.1f} ms" + (f", errors: {errors}" if errors else ""),
          file=sys.stderr, flush=True)
    return summary


def measure(plan: Sequence[tuple[Target, Sequence[Figure]]], repeat: int, gate: QuietGate | None = None,
            slo: SLO | None = None) -> Runs:
    """Every figure of every target `repeat` times; each run waits for `gate` (a quiet machine) first.

    Interleaved: repeat 0 of every figure of every target, then repeat 1, ... so that a change in
    the machine's background load hits every figure alike instead of skewing one ratio.
    """
    runs: Runs = {t.name: {f.name: [] for f in figs} for t, figs in plan}
    for r in range(repeat):
        for target, figures in plan:
            for figure in figures:
                runs[target.name][figure.name].append(_measure_once(target, figure, r, repeat, gate, slo))
    return runs


def medians(runs: Runs) -> dict[str, dict[str, Summary]]:
    return {t: {f: median_summary(found) for f, found in figs.items()} for t, figs in runs.items()}


def model_vocab(model: str) -> list[int]:
    return usable_token_ids(AutoTokenizer.from_pretrained(resolve_model(model)))
