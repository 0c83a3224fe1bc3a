"""How many CPU threads torch may use for an engine step.

On a CPU-only machine the launcher shares the cores out between the engines it starts (a context
and a generation server on 2 cores get one thread each), so that engines under load do not fight
over cores. A prefill on an otherwise idle machine would leave the other engines' cores unused:
the unloaded time to first token of a disaggregated pair is then a one-thread prefill against the
aggregated server's two-thread one. `BorrowIdleCores` takes those cores for big steps while they
are idle: before a step of at least `min_tokens` tokens it reads how many tasks the kernel has
runnable at this moment (`/proc/loadavg`) and adds one thread per idle CPU, up to the CPUs this
process may run on. Decode steps, and steps on a busy machine, keep the engine's share. (A core
that gets busy during the step is shared for the rest of that step; the next step sees it.)
`FixedThreads` is the null policy: GPU engines, a share that is already every CPU, no
`/proc/loadavg`, or `borrow_idle_cores: false` (the default).

Opt-in because it did not pay on the 2-core VM the benchmarks run on (docs/BENCHMARKS.md): the
context engine of a pair is idle between prefills, the vCPUs it would borrow wake slowly, and a
two-thread prefill right after an idle spell took longer than a one-thread one (unloaded TTFT
16.1 ms without, 18.0 ms with, same run); under load it gained about 2% throughput.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

LOADAVG = "/proc/loadavg"
MIN_TOKENS = 64  # below this a step is decode-like: more threads cost more than they give


class FixedThreads:
    """Leave torch's thread count alone."""

    def before_step(self, num_tokens: int) -> None:
        pass


class BorrowIdleCores:
    """The engine's `share` of threads, plus the CPUs idle at the start of a big step."""

    def __init__(self, share: int, cpus: int, probe: Callable[[], int | None],
                 min_tokens: int = MIN_TOKENS, set_threads: Callable[[int], None] = torch.set_num_threads) -> None:
        self.share, self.cpus, self.min_tokens = share, cpus, min_tokens
        self._probe, self._set = probe, set_threads
        self.current = share

    def threads_for(self, num_tokens: int) -> int:
        if num_tokens < self.min_tokens:
            return self.share
        runnable = self._probe()  # counts this thread too
        if runnable is None:
            return self.share
        idle = self.cpus - max(1, runnable)
        return max(self.share, min(self.cpus, 1 + idle))

    def before_step(self, num_tokens: int) -> None:
        threads = self.threads_for(num_tokens)
        if threads != self.current:
            self._set(threads)
            self.current = threads


def runnable_tasks(path: str = LOADAVG) -> int | None:
    """Tasks the kernel has running or ready to run right now (4th field of /proc/loadavg: "R/T")."""
    try:
        with open(path, "rb") as f:
            return int(f.read().split()[3].split(b"/")[0])
    except (OSError, IndexError, ValueError):
        return None


def cpu_threads_policy(device: torch.device, borrow_idle_cores: bool) -> FixedThreads | BorrowIdleCores:
    """The policy for an engine on `device`; its share is torch's thread count at this point."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    share = torch.get_num_threads()
    if device.type != "cpu" or not borrow_idle_cores or share >= cpus or runnable_tasks() is None:
        return FixedThreads()
    return BorrowIdleCores(share, cpus, runnable_tasks)
