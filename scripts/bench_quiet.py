"""Wait for a quiet machine before each measured figure (other work shares these 2 cores).

`busy_fraction` samples /proc/stat: the share of all cores' time spent outside idle/iowait over a
short window. The servers under test are idle between figures, so what shows is other load.
`QuietGate.wait` polls until that share drops under `max_busy` or `timeout_s` passes; it returns
the last sample, recorded with the figure so that a reader can see how quiet it was.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

PROC_STAT = Path("/proc/stat")


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
