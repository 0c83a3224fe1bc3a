"""Disk tier figure, engine level: a disk-tier hit of a 4,096-token prompt
against a miss (goal: <= 0.4 of a miss), on the 8B-shaped model (`pdserve_bench.gpu_handoff.build_model`),
the engine built as `pdserve serve` builds it (scripts/bench_gpu.py `make_core`).

- steady state: a new 4k prompt (miss), the same again (GPU hit), nine other 4k prompts that push
  its blocks through the primary pool (5 prompts) and the host pool (1.5 prompts) down to the disk
  tier, then the prompt again (disk hit: files read and checked, promoted to the host pool while
  the host's own blocks go down to disk, onboarded while primary blocks go to the host); warm
  (the files in the page cache) and cold (`posix_fadvise(DONTNEED)` after fsync drops them);
- after a restart: the engine closed (queued writes land) and built again on the same directory;
  the prompt hits the blocks it finds there, primary and host pools empty (no evictions), cold.

    python scripts/bench_gpu_disk.py --workdir /tmp/bench-gpu [--layers 32] [--disk-dir DIR]

Each disk-hit figure carries `engine_spans` (where the hit's time went on the engine thread:
scripts/disk_hit_spans.py) and, cold, `raw_disk_read_gb_s`: as many of the directory's files read
cold with plain preadv on 16 threads, nothing checked (the disk's own bound). On a CPU, the same flow
with the 8B KV layout and tiny weights (float32 KV; a 1,024-token prompt keeps the prefills short):

    PYTHONPATH=$PWD python scripts/bench_gpu_disk.py --small --prompt-tokens 1024 --repeats 1

Prints one JSON line per figure and a SUMMARY line; `--out FILE` also writes them as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from pathlib import Path

import torch
from bench_gpu import RESULTS, ceilings, make_core, record, ttft_ms
from disk_hit_spans import install, raw_read_gb_s, spans_of

from pdserve_bench.gpu_handoff import build_model
from server.models.model_spec import load_spec

# `--small`: the 8B model's KV layout (32 layers x 8 kv heads x 128) with tiny weights, to run the
# engine-level flow on a CPU (docs/BENCHMARKS.md "Disk tier, engine level")
SMALL = dict(hidden_size=512, intermediate_size=1024, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
             vocab_size=512)
TOKENS = 4096  # a prompt's tokens (`--prompt-tokens`)
VOCAB = 30000


def prompt(n: int) -> list[int]:
    return torch.randint(10, VOCAB, (n,)).tolist()


def tiers(disk_dir: Path, model_dir: Path, dtype: torch.dtype) -> dict:
    """Primary 5 prompts, host 1.5, disk 16 (a 4k prompt's KV: 512 MiB for the 32-layer model in
    bf16); room for 8 prompts' writes in the queue."""
    prompt_bytes = TOKENS * load_spec(model_dir).cache_layout(8192, dtype, "cpu").bytes_per_token()
    disk = {"path": str(disk_dir), "max_bytes": 16 * prompt_bytes, "read_threads": min(16, os.cpu_count() or 1),
            "write_threads": 4, "write_queue_bytes": 8 * prompt_bytes}
    return {"max_tokens": 5 * TOKENS, "host_cache_size": prompt_bytes * 3 // 2, "disk": disk}


def writes_landed(core) -> None:
    deadline = time.monotonic() + 120
    while core.kv.stats().disk_queued_bytes and time.monotonic() < deadline:
        time.sleep(0.01)


def drop_page_cache(disk_dir: Path, files: list[Path] | None = None) -> None:
    """Write the block files out and drop them from the page cache, so the next read is from the disk."""
    for path in disk_dir.glob("w*/*.kv") if files is None else files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk_hit(core, a: list[int], disk_dir: Path, cold: bool) -> dict[str, float]:
    writes_landed(core)
    if cold:
        drop_page_cache(disk_dir)
    before = core.kv.stats()
    ms, spans = spans_of(lambda: ttft_ms(core, a))
    after = core.kv.stats()
    out = {"ttft_ms": ms, "disk_onboards": after.disk_onboards - before.disk_onboards,
           "bytes_read": after.disk_bytes_read - before.disk_bytes_read,
           "dropped": sum(after.disk_dropped.values()) - sum(before.disk_dropped.values()), "spans": spans}
    if cold:  # the disk itself: as many files read cold with plain preadv, nothing checked
        files = sorted(disk_dir.glob("w*/*.kv"))[:max(1, out["disk_onboards"])]
        out["raw_disk_read_gb_s"] = round(raw_read_gb_s(files, lambda f: drop_page_cache(disk_dir, f)), 2)
    return out


def steady_cycle(core, disk_dir: Path, cold: bool) -> tuple[float, float, dict[str, float], float]:
    """(miss, GPU hit, disk hit, busy miss) of one new prompt. The miss, like the disk hit, starts once
    the disk writes queued before it landed; the busy miss (another new prompt, first) does not: it
    shares the CPU with the writers of the last cycle's fills."""
    busy = ttft_ms(core, prompt(TOKENS))
    a = prompt(TOKENS)
    writes_landed(core)
    miss, gpu_hit = ttft_ms(core, a), ttft_ms(core, a)
    for _ in range(9):
        ttft_ms(core, prompt(TOKENS))
    return miss, gpu_hit, disk_hit(core, a, disk_dir, cold), busy


def steady_figures(model_dir: Path, args: argparse.Namespace, disk_dir: Path) -> tuple[list[int], float]:
    """The warm and cold cycles; then a last prompt pushed to disk for the restart (it and its miss)."""
    core, _ = make_core(model_dir, args, tiers(disk_dir, model_dir, kv_dtype(args)))
    ttft_ms(core, prompt(TOKENS))  # the first request after start pays one-time costs
    steady_miss = None  # the warm cycles' miss: a cold cycle's own miss also competes with the disk's writeback
    for cold in (False, True):
        cycles = [steady_cycle(core, disk_dir, cold) for _ in range(args.repeats)]
        miss = statistics.median(c[0] for c in cycles)
        steady_miss = steady_miss or miss
        hit = statistics.median(c[2]["ttft_ms"] for c in cycles)
        last = cycles[-1][2]
        record(f"disk_tier_{'cold' if cold else 'warm'}", miss_ttft_ms=miss,
               gpu_hit_ttft_ms=statistics.median(c[1] for c in cycles), disk_hit_ttft_ms=hit,
               disk_hit_vs_miss=hit / miss, disk_hit_vs_warm_miss=hit / steady_miss,
               busy_miss_ttft_ms=statistics.median(c[3] for c in cycles), disk_onboarded_blocks=last["disk_onboards"],
               read_gb_s=last["bytes_read"] / max(1e-9, hit / 1000) / 1e9, dropped=last["dropped"],
               engine_spans_last=last["spans"], raw_disk_read_gb_s=last.get("raw_disk_read_gb_s"),
               cycles_miss_gpu_disk_busy_ms=[[round(c[0], 1), round(c[1], 1), round(c[2]["ttft_ms"], 1), round(c[3], 1)]
                                             for c in cycles],
               goal="disk hit <= 0.4 of a miss")
    a = prompt(TOKENS)
    miss = ttft_ms(core, a)
    for _ in range(9):
        ttft_ms(core, prompt(TOKENS))
    writes_landed(core)
    core.kv.close()
    del core
    torch.cuda.empty_cache()
    return a, miss


def restart_figure(model_dir: Path, args: argparse.Namespace, disk_dir: Path, a: list[int], miss: float) -> None:
    core, start_s = make_core(model_dir, args, tiers(disk_dir, model_dir, kv_dtype(args)))
    restored = core.kv.stats().disk_restored
    ttft_ms(core, prompt(TOKENS))  # one-time costs, and a miss that takes primary slots only
    hit = disk_hit(core, a, disk_dir, cold=True)
    record("disk_tier_restart_cold", restored_blocks=restored, startup_s=start_s, disk_hit_ttft_ms=hit["ttft_ms"],
           miss_ttft_ms=miss, disk_hit_vs_miss=hit["ttft_ms"] / miss, disk_onboarded_blocks=hit["disk_onboards"],
           read_gb_s=hit["bytes_read"] / max(1e-9, hit["ttft_ms"] / 1000) / 1e9, goal="<= 0.4 of a miss",
           engine_spans=hit["spans"], raw_disk_read_gb_s=hit["raw_disk_read_gb_s"])
    core.kv.close()


def kv_dtype(args: argparse.Namespace) -> torch.dtype:
    if args.dtype != "auto":
        return getattr(torch, args.dtype)
    return torch.bfloat16 if torch.cuda.is_available() else torch.float32


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/bench-gpu"))
    parser.add_argument("--disk-dir", type=Path, help="the disk tier's directory (default: WORKDIR/kv-disk)")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kernels", default="auto")
    parser.add_argument("--no-graphs", action="store_true")
    parser.add_argument("--max-num-tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--small", action="store_true", help="tiny weights, the 8B KV layout (a CPU run)")
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--dtype", default="auto", help="the engine's dtype (auto: bfloat16 on CUDA, float32 on CPU)")
    parser.add_argument("--chunk-bytes", type=int, help="the disk tier's read/write/hash piece size (a trial of "
                                                        "kvcache/disk_format.py CHUNK_BYTES)")
    parser.add_argument("--read-chunk-bytes", type=int, help="the same for reads only (READ_CHUNK_BYTES)")
    args = parser.parse_args()
    import kvcache.disk_store
    if args.chunk_bytes:
        kvcache.disk_store.CHUNK_BYTES = kvcache.disk_store.READ_CHUNK_BYTES = args.chunk_bytes
    if args.read_chunk_bytes:
        kvcache.disk_store.READ_CHUNK_BYTES = args.read_chunk_bytes
    global TOKENS, VOCAB
    TOKENS = args.prompt_tokens
    install()
    torch.manual_seed(0)
    if torch.cuda.is_available():
        ceilings()
    if args.small:
        VOCAB = SMALL["vocab_size"]
        model_dir = build_model(args.workdir / f"small-8b-kv-{args.layers}", args.layers, text_tokens=512, shape=SMALL)
    else:
        model_dir = build_model(args.workdir / f"llama8b-shaped-{args.layers}", args.layers)
    disk_dir = args.disk_dir or args.workdir / "kv-disk"
    shutil.rmtree(disk_dir, ignore_errors=True)
    a, miss = steady_figures(model_dir, args, disk_dir)
    restart_figure(model_dir, args, disk_dir, a, miss)
    print("SUMMARY " + json.dumps(RESULTS), flush=True)
    if args.out:
        args.out.write_text("".join(json.dumps(r) + "\n" for r in RESULTS))


if __name__ == "__main__":
    main()
