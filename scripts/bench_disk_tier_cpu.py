"""The disk tier's read and write paths on the CPU: the same KVCacheManager code
the GPU benchmark (scripts/bench_gpu_disk.py) runs, at its sizes, with CPU pools.

Layout: 32 layers x 8 kv heads x 128 head_dim, float16, 32 tokens per block: 4 MiB a block, and a
4,096-token prompt is 128 blocks = 512 MiB. Primary pool 2 prompts, host pool 1.5, disk 6, write
queue 6 (this VM's disk absorbs writes at ~1 GB/s: a shorter queue refuses, and drops, blocks).

Figures (one JSON line each, then a SUMMARY line):
- write: 5 prompts push a prompt through primary and host down to disk; the host's evictions are
  written (blocks queued on the engine thread, files written by the writer threads): GB/s written
  from the first push until every write landed, and the engine thread's share of it;
- read_warm / read_cold: `DiskStore.read_many` of the prompt's 128 files (read and checked), from
  the page cache, and after fsync + posix_fadvise(DONTNEED);
- onboard_warm / onboard_cold: `admit` of the prompt again (files read and checked, promoted to the
  host pool while host blocks go down to disk, onboarded into primary while primary blocks go to the
  host): KV bytes read from disk per second of the whole admit;
- onboard_restart: the manager closed and opened again on the directory, the prompt admitted (its
  blocks found on disk, empty pools: no evictions), cold.
`--profile FILE` writes a cProfile of one warm onboarding (the engine thread's view).

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python scripts/bench_disk_tier_cpu.py [--blocks 128] [--repeats 3]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from bench_gpu_disk import drop_page_cache

from kvcache import CacheLayout, KvCacheConfig, KVCacheManager, KVFormat, Level
from kvcache.config import DiskTierConfig

KEY = bytes(range(32))
RESULTS: list[dict] = []


def record(name: str, **fields) -> None:
    row = {"figure": name, **{k: round(v, 3) if isinstance(v, float) else v for k, v in fields.items()}}
    RESULTS.append(row)
    print(json.dumps(row), flush=True)


def make(args: argparse.Namespace, path: Path) -> KVCacheManager:
    tokens = args.blocks * args.tpb
    layout = CacheLayout((tokens * 2,) * args.layers, KVFormat(torch.float16, args.heads, args.dim), "cpu", tokens * 2)
    prompt_bytes = tokens * layout.bytes_per_token()
    disk = DiskTierConfig(path=str(path), max_bytes=6 * prompt_bytes, read_threads=args.read_threads,
                          write_threads=args.write_threads, write_queue_bytes=6 * prompt_bytes)
    config = KvCacheConfig(tokens_per_block=args.tpb, max_tokens=2 * tokens, host_cache_size=prompt_bytes * 3 // 2,
                           secondary_offload_min_priority=0, disk=disk)
    return KVCacheManager(config, layout, salt="bench", disk_key=KEY)


def prompt(args: argparse.Namespace, i: int) -> list[int]:
    return [i * 1_000_003 + t for t in range(args.blocks * args.tpb)]


def prefill(m: KVCacheManager, rid: str, tokens: list[int]) -> int:
    hit = m.admit(rid, tokens, num_tokens=len(tokens))
    m.commit(rid, tokens, len(tokens))
    m.release(rid)
    return hit


def landed(m: KVCacheManager) -> None:
    deadline = time.monotonic() + 300
    while (m.stats().disk_queued_bytes or m._disk.store._pending) and time.monotonic() < deadline:
        time.sleep(0.002)


def push_down(m: KVCacheManager, args: argparse.Namespace, first: int) -> dict[str, float]:
    """Five new prompts push the older ones down; the write figure of their evictions to disk."""
    before = m.stats().disk_bytes_written
    t0 = time.perf_counter()
    for i in range(first, first + 5):
        prefill(m, f"p{i}", prompt(args, i))
    engine_s = time.perf_counter() - t0
    landed(m)
    total_s = time.perf_counter() - t0
    written = m.stats().disk_bytes_written - before
    return {"bytes": written, "gb_s": written / total_s / 1e9, "engine_s": engine_s, "total_s": total_s}


def disk_items(m: KVCacheManager, tokens: list[int]) -> list[tuple[int, int, bytes]]:
    from kvcache.hashing import block_hashes
    g = m._groups[0]
    hashes = block_hashes(tokens, m.tokens_per_block, "bench")
    blocks = [g.bm.tree.by_hash.get(h) for h in hashes]
    return [(g.window, b.slot, b.hash) for b in blocks if b is not None and b.level is Level.DISK]


def read_figure(m: KVCacheManager, tokens: list[int], path: Path, cold: bool) -> float:
    items = disk_items(m, tokens)
    if cold:
        drop_page_cache(path)
    t0 = time.perf_counter()
    out = m._disk.store.read_many(items)
    dt = time.perf_counter() - t0
    assert len(items) == len(out) and all(isinstance(o, memoryview) for o in out), "a file failed its check"
    buffers = getattr(m._disk.store, "buffers", None)  # reused read buffers (absent before they were)
    for o in out if buffers is not None else ():
        buffers.give(o)
    return sum(o.nbytes for o in out) / dt / 1e9


def onboard(m: KVCacheManager, tokens: list[int], path: Path, cold: bool, rid: str,
            profile: cProfile.Profile | None = None) -> dict[str, float]:
    landed(m)
    if cold:
        drop_page_cache(path)
    before = m.stats()
    t0 = time.perf_counter()
    if profile is not None:
        profile.enable()
    hit = m.admit(rid, tokens, num_tokens=len(tokens))
    if profile is not None:
        profile.disable()
    dt = time.perf_counter() - t0
    after = m.stats()
    m.commit(rid, tokens, len(tokens))
    m.release(rid)
    read = after.disk_bytes_read - before.disk_bytes_read
    assert hit >= len(tokens) - m.tokens_per_block and read > 0, (hit, read)
    return {"ms": dt * 1000, "gb_s": read / dt / 1e9, "blocks": after.disk_onboards - before.disk_onboards}


def cycle(m: KVCacheManager, args: argparse.Namespace, path: Path, n: int, cold: bool,
          profile: cProfile.Profile | None) -> dict[str, float]:
    a = prompt(args, 1000 + n)
    prefill(m, f"a{n}", a)
    w = push_down(m, args, 10 * n + 1)
    s = m.stats()
    assert len(disk_items(m, a)) == args.blocks, f"the prompt did not reach the disk tier: dropped {s.disk_dropped}"
    r = read_figure(m, a, path, cold)
    o = onboard(m, a, path, cold, f"a{n}-hit", profile)
    return {"write_gb_s": w["gb_s"], "write_engine_s": w["engine_s"], "read_gb_s": r, **{f"onboard_{k}": v for k, v
                                                                                         in o.items()}}


def summarize(name: str, cycles: list[dict[str, float]]) -> None:
    record(name, **{k: statistics.median(c[k] for c in cycles) for k in cycles[0]}, repeats=len(cycles))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=128, help="blocks of a prompt (4 MiB each)")
    parser.add_argument("--tpb", type=int, default=32)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--read-threads", type=int, default=8)
    parser.add_argument("--write-threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, help="the disk tier's directory (default: a temporary one)")
    parser.add_argument("--profile", type=Path, help="write a cProfile of one warm onboarding here")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    path = args.dir or Path(tempfile.mkdtemp(prefix="bench-disk-")) / "kv"
    shutil.rmtree(path, ignore_errors=True)
    m = make(args, path)
    try:
        prof = cProfile.Profile() if args.profile else None
        warm = [cycle(m, args, path, n, False, prof if n == 0 else None) for n in range(args.repeats)]
        summarize("warm", warm)
        summarize("cold", [cycle(m, args, path, args.repeats + n, True, None) for n in range(args.repeats)])
        a = prompt(args, 5000)
        prefill(m, "last", a)
        push_down(m, args, 5001)
        landed(m)
    finally:
        m.close()
    m = make(args, path)
    try:
        o = onboard(m, a, path, True, "restart")
        record("restart_cold", onboard_ms=o["ms"], onboard_gb_s=o["gb_s"], blocks=o["blocks"])
    finally:
        m.close()
        shutil.rmtree(path, ignore_errors=True)
    if prof is not None:
        prof.dump_stats(args.profile)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
    print("SUMMARY " + json.dumps(RESULTS), flush=True)
    if args.out:
        args.out.write_text("".join(json.dumps(r) + "\n" for r in RESULTS))


if __name__ == "__main__":
    main()
