"""The CPU's floors under a disk-tier hit, for docs/BENCHMARKS.md "Disk tier on
the H200": how fast this machine copies block rows between pinned host memory and the disk tier's
buffers (the two copies a hit makes: evicted host rows out, promoted rows in) and how fast it
computes the payload MAC (HMAC-SHA256, what a read checks) on 1..16 threads. Best of a few runs.

    python scripts/disk_floors.py [--blocks 127] [--out FILE]

Prints one JSON line (GB/s per case); `--out` writes it too.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import hmac
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

BLOCK = 4 << 20  # one block of the 8B shape: 32 tokens x 128 KiB


def gb_s(fn: Callable[[], object], nbytes: int, reps: int = 3) -> float:
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return round(nbytes / best / 1e9, 2)


def copy_floors(n: int) -> dict[str, float]:
    pinned = torch.ones((n, BLOCK), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    bufs = [bytearray(BLOCK) for _ in range(n)]
    views = [torch.frombuffer(b, dtype=torch.uint8) for b in bufs]
    rows = list(pinned.unbind(0))
    out = {}
    threads = torch.get_num_threads()
    for t in sorted({threads, 8, 4, 1}, reverse=True):
        torch.set_num_threads(t)
        out[f"rows_to_buffers_{t}t"] = gb_s(lambda: torch._foreach_copy_(views, rows), n * BLOCK)
        out[f"buffers_to_rows_{t}t"] = gb_s(lambda: torch._foreach_copy_(rows, views), n * BLOCK)
    torch.set_num_threads(threads)
    return out


def hmac_floors(n: int) -> dict[str, float]:
    bufs = [os.urandom(BLOCK) for _ in range(min(n, 32))]
    key = b"k" * 32

    def mac(i: int, piece: int) -> bytes:
        h, view = hmac.new(key, digestmod=hashlib.sha256), memoryview(bufs[i % len(bufs)])
        for at in range(0, BLOCK, piece):
            h.update(view[at:at + piece])
        return h.digest()

    out = {}
    for threads in (1, 8, 16):
        for piece in (256 << 10, 1 << 20, 4 << 20):
            def run(threads: int = threads, piece: int = piece) -> None:
                with concurrent.futures.ThreadPoolExecutor(threads) as pool:
                    list(pool.map(lambda i: mac(i, piece), range(n)))
            out[f"hmac_{threads}t_{piece >> 10}k"] = gb_s(run, n * BLOCK, reps=2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=127, help="blocks of 4 MiB (127: a 4k prompt's hit)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    result = {"figure": "disk_floors", "blocks": args.blocks, "cores": os.cpu_count(),
              **copy_floors(args.blocks), **hmac_floors(args.blocks)}
    line = json.dumps(result)
    print(line, flush=True)
    if args.out:
        args.out.write_text(line + "\n")


if __name__ == "__main__":
    main()
