"""The load client: one run's traffic spread over N worker processes, results gathered back.

`plan_jobs` splits a `LoadPlan` into one `WorkerJob` per process: closed-loop streams and open-loop
arrivals are dealt round robin (stream k and arrival k to process k mod N), so every process gets
an even share of the staggered starts. `run_load` starts `python -m pdserve_bench.load_worker` per
job, waits until every worker is ready, gives them one start time a moment ahead, and reads their
`Timing` lines (JSON) until each sends `Done`. Every wait has a deadline; a worker that misses it is
killed and the run fails naming it.
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec

from pdserve_bench.arrivals import poisson_offsets, shares, stream_starts
from pdserve_bench.load_job import READY, Arrival, Done, Go, Stream, Timing, Traffic, WorkerJob, encode_line
from pdserve_bench.record import REPO
from pdserve_bench.stats import RequestResult

READY_TIMEOUT_S = 60.0  # a worker imports aiohttp and msgspec only; generous for a loaded machine
START_DELAY_S = 0.25  # between the go line and the run's start, so that every worker starts together
REQUEST_TIMEOUT_S = 300.0


def default_procs() -> int:
    return min(8, len(os.sched_getaffinity(0)))


@dataclass(frozen=True)
class LoadPlan:
    """One run: its classes of traffic, how long requests keep starting, the ramp."""

    traffic: tuple[Traffic, ...]
    duration_s: float | None = None
    ramp_s: float = 0.0
    request_timeout_s: float = REQUEST_TIMEOUT_S

    def __post_init__(self) -> None:
        if not self.traffic:
            raise ValueError("a load plan needs at least one class of traffic")
        names = [t.name for t in self.traffic]
        if len(set(names)) != len(names):
            raise ValueError(f"traffic names must differ, got {names}")
        for t in self.traffic:
            t.check(self.duration_s)

    def time_limit_s(self) -> float:
        """How long the whole run may take before its workers are killed (plus the last open-loop
        arrival's offset, which only the drawn schedule knows)."""
        longest = max((-(-t.count // t.concurrency) if t.closed and t.count else 1) for t in self.traffic)
        bounded = 1 if self.duration_s is not None else longest  # requests one after another per stream
        return READY_TIMEOUT_S + self.ramp_s + (self.duration_s or 0.0) + self.request_timeout_s * bounded


def _streams(t: Traffic, ramp_s: float) -> list[Stream]:
    counts = shares(t.count, t.concurrency) if t.count is not None else [None] * t.concurrency
    return [Stream(t.name, k, start, counts[k]) for k, start in enumerate(stream_starts(t.concurrency, ramp_s))]


def _arrivals(t: Traffic, plan: LoadPlan) -> list[Arrival]:
    offsets = poisson_offsets(t.rate, seed=t.seed, duration_s=plan.duration_s, count=t.count, ramp_s=plan.ramp_s)
    return [Arrival(t.name, k, at) for k, at in enumerate(offsets)]


def plan_jobs(plan: LoadPlan, url: str, model: str, vocab: Sequence[int], procs: int) -> list[WorkerJob]:
    """One job per process that has work (at most `procs`)."""
    streams = [s for t in plan.traffic if t.closed for s in _streams(t, plan.ramp_s)]
    arrivals = [a for t in plan.traffic if not t.closed for a in _arrivals(t, plan)]
    used = max(1, min(procs, len(streams) + len(arrivals)))
    return [WorkerJob(url, model, list(vocab), list(plan.traffic), streams[i::used], arrivals[i::used],
                      plan.duration_s, plan.request_timeout_s) for i in range(used)]


@dataclass
class LoadResults:
    t0: float  # perf_counter() of the run's start: time-series bins count from here
    by_traffic: dict[str, list[RequestResult]] = field(default_factory=dict)
    workers: int = 0
    done: list[Done] = field(default_factory=list)  # each worker's CPU time

    @property
    def busiest_worker(self) -> float:
        """The largest share of one core a worker used (near 1: the client may have limited the run)."""
        return max((d.busy for d in self.done), default=0.0)

    @property
    def all(self) -> list[RequestResult]:
        return sorted((r for rs in self.by_traffic.values() for r in rs), key=lambda r: r.start)


class _Worker:
    """One worker process and the thread that moves its stdout lines into the shared queue."""

    def __init__(self, index: int, lines: queue.Queue[tuple[int, bytes | None]]) -> None:
        self.index = index
        # `-m` from the repository root: the worker runs this checkout's pdserve_bench
        self.proc = subprocess.Popen([sys.executable, "-m", "pdserve_bench.load_worker"], cwd=REPO,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.reader = threading.Thread(target=self._pump, args=(lines,), daemon=True)
        self.reader.start()

    def _pump(self, lines: queue.Queue[tuple[int, bytes | None]]) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            lines.put((self.index, line))
        lines.put((self.index, None))

    def send(self, data: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        self.reader.join(timeout=10)


def _next(lines: queue.Queue[tuple[int, bytes | None]], deadline: float, what: str) -> tuple[int, bytes | None]:
    try:
        return lines.get(timeout=max(0.0, deadline - time.monotonic()))
    except queue.Empty:
        raise TimeoutError(f"load client: {what} not within the time limit") from None


def _wait_ready(workers: list[_Worker], lines: queue.Queue, deadline: float) -> None:
    waiting = {w.index for w in workers}
    while waiting:
        index, line = _next(lines, deadline, f"workers {sorted(waiting)} ready")
        if line is None or line.strip() != READY.encode():
            raise RuntimeError(f"load worker {index} did not start: {line!r} (exit {workers[index].proc.poll()})")
        waiting.discard(index)


def _collect(workers: list[_Worker], lines: queue.Queue, deadline: float, out: LoadResults) -> None:
    timings, finished = msgspec.json.Decoder(Timing), msgspec.json.Decoder(Done)
    running = {w.index for w in workers}
    while running:
        index, line = _next(lines, deadline, f"workers {sorted(running)} done")
        if line is None and index not in running:
            continue  # the end of a worker that has sent Done
        if line is None:
            raise RuntimeError(f"load worker {index} exited with {workers[index].proc.wait(timeout=10)} before done")
        if line.startswith(b"{"):  # Done is an object, Timing an array
            out.done.append(finished.decode(line))
            running.discard(index)
            continue
        timing = timings.decode(line)
        out.by_traffic.setdefault(timing.traffic, []).append(timing.result())


def run_load(plan: LoadPlan, url: str, model: str, vocab: Sequence[int], procs: int) -> LoadResults:
    """Run `plan` against `url` from up to `procs` processes; every request's result, by traffic."""
    jobs = plan_jobs(plan, url, model, vocab, procs)
    lines: queue.Queue[tuple[int, bytes | None]] = queue.Queue()
    workers: list[_Worker] = []
    try:
        for index in range(len(jobs)):
            workers.append(_Worker(index, lines))
        for worker, job in zip(workers, jobs, strict=True):  # all started first: they import meanwhile
            worker.send(encode_line(job))
        _wait_ready(workers, lines, time.monotonic() + READY_TIMEOUT_S)
        out = LoadResults(time.perf_counter() + START_DELAY_S, {t.name: [] for t in plan.traffic}, len(workers))
        for worker in workers:
            worker.send(encode_line(Go(out.t0)))
        last_arrival = max((a.at for job in jobs for a in job.arrivals), default=0.0)  # a count spreads them
        _collect(workers, lines, time.monotonic() + plan.time_limit_s() + last_arrival, out)
        return out
    finally:
        for worker in workers:
            worker.stop()
