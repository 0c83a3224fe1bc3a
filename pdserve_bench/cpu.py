"""CPU accounting on a shared machine: how busy it is, waiting for quiet, CPU time of a server.

`busy_fraction` samples /proc/stat: the share of all cores' time spent outside idle/iowait over a
short window. The servers under test are idle between figures, so what shows is other load.
`QuietGate.wait` polls until that share drops under `max_busy` or `timeout_s` passes; it returns
the last sample, recorded with the figure so that a reader can see how quiet it was.
`tree_cpu_s` sums user+system time of a process and its live descendants (a launched server and
its children): CPU per output token is far less sensitive to other load than wall-clock rates.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
PROC_STAT = PROC / "stat"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_times(stat_text: str) -> tuple[int, int]:
    """(busy, total) jiffies from the aggregate `cpu ` line of /proc/stat."""
    for line in stat_text.splitlines():
        if line.startswith("cpu "):
            values = [int(v) for v in line.split()[1:]]
            idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
            total = sum(values[:8])  # user nice system idle iowait irq softirq steal (guest is in user)
            return total - idle, total
    raise ValueError("no aggregate 'cpu ' line in /proc/stat")


def busy_fraction(window_s: float = 0.5) -> float:
    """Share of the machine's CPU time that was busy during the next `window_s` seconds."""
    busy0, total0 = cpu_times(PROC_STAT.read_text())
    time.sleep(window_s)
    busy1, total1 = cpu_times(PROC_STAT.read_text())
    return (busy1 - busy0) / (total1 - total0) if total1 > total0 else 0.0


@dataclass(frozen=True)
class QuietGate:
    max_busy: float = 0.25  # of all cores
    timeout_s: float = 60.0
    window_s: float = 0.5

    def wait(self) -> float:
        """Block until the machine is quiet or the timeout passes; the last busy fraction."""
        deadline = time.monotonic() + self.timeout_s
        busy = busy_fraction(self.window_s)
        while busy > self.max_busy and time.monotonic() < deadline:
            busy = busy_fraction(self.window_s)
        if busy > self.max_busy:
            print(f"  (machine still {busy:.0%} busy after {self.timeout_s:.0f} s; measuring anyway)",
                  file=sys.stderr, flush=True)
        return busy


def ppid_and_cpu_ticks(pid_stat: str) -> tuple[int, int]:
    """(parent pid, utime + stime ticks) from one /proc/PID/stat line."""
    fields = pid_stat[pid_stat.rindex(")") + 2:].split()  # after "PID (comm) ": state is fields[0]
    return int(fields[1]), int(fields[11]) + int(fields[12])


def process_table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, CPU ticks) of every live process."""
    table = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            try:
                table[int(entry.name)] = ppid_and_cpu_ticks((entry / "stat").read_text())
            except (OSError, ValueError, IndexError):
                continue  # exited meanwhile
    return table


def descendants(table: dict[int, tuple[int, int]], root: int) -> list[int]:
    """`root` (when alive) and all its live descendants (the launcher starts each server in its own
    session, so a process group would miss them)."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid in table:
            found.append(pid)
            todo += children.get(pid, [])
    return found


def tree_cpu_ticks(table: dict[int, tuple[int, int]], root: int) -> int:
    """CPU ticks of `root` and all its live descendants."""
    return sum(table[pid][1] for pid in descendants(table, root))


def tree_cpu_s(root: int) -> float:
    """CPU seconds used so far by process `root` and its live descendants."""
    return tree_cpu_ticks(process_table(), root) / CLOCK_TICKS
