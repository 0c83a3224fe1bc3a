"""FP8 KV cache against a bf16 KV cache on one GPU, the 8B shape, in the same run.

The random-weight bf16 model with Llama-3.1-8B dimensions (`pdserve_bench.gpu_handoff.build_model`);
every figure is measured for `kv_cache_config.dtype: auto` (bf16) and `fp8`, interleaved or back
to back in one process, and reported as FP8 / bf16:

- handoff: a context/generation pair per KV dtype (`pdserve serve`, the same-GPU CUDA IPC path),
  one pair at a time (two 8B pairs do not fit an 80 GB GPU), the same fresh 4,096-token prompts
  through each. The generation server
  reports the bytes and seconds of each pull (`pdserve_kv_transfer_bytes_total`,
  `pdserve_kv_transfer_seconds_sum`). Goal: FP8 moves 0.5x the bytes in <= 0.6x the time.
- host tier: an engine per dtype (as `pdserve serve` builds it, no HTTP) with a 5 x 4k-token GPU
  pool and a host pool; a 4k prompt pushed out to the host by five others, then hit again: TTFT of
  the host hit (median of 3 cycles). Goal: FP8 <= 0.6x bf16.
- decode: an engine per dtype (CUDA graphs), 64 requests of 2,048-token prompts decoding together:
  tok/s over decode-only steps (median of the repeats). Goal: FP8 >= 1.3x bf16.

    python scripts/bench_gpu_fp8_kv.py --workdir /tmp/bench-gpu [--layers 32] [--repeats 3]

About 3 minutes on an H200 with the model already built (building it adds about a minute). Prints
one JSON line per figure and a SUMMARY line; `--out FILE` also writes them as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from bench_gpu import RESULTS, ceilings, drive, make_core, prompt, record, submit, ttft_ms

from pdserve_bench.gpu_handoff import TOKEN, build_model, metric, one_handoff, wait_healthy

REPO = Path(__file__).resolve().parents[1]
DTYPES = ("auto", "fp8")  # kv_cache_config.dtype: bf16 (the model's), then FP8
PORTS = {"auto": (18811, 18812), "fp8": (18821, 18822)}  # (context, generation)


def start_server(workdir: Path, model: Path, role: str, kv_dtype: str) -> subprocess.Popen:
    ctx_port, gen_port = PORTS[kv_dtype]
    port = ctx_port if role == "context" else gen_port
    # the generation server knows its context server; the context server sends a prompt's KV after
    # its prefill, in one pull (not streamed while prefilled), so each pull is one whole 4k prompt
    peers = {"context_urls": [f"127.0.0.1:{ctx_port}"]} if role == "generation" else {"kv_stream": "off"}
    cfg = workdir / f"fp8kv-{kv_dtype}-{role}.yaml"
    cfg.write_text(json.dumps({**peers, "model": str(model), "hostname": "127.0.0.1", "port": port,
                               "max_seq_len": 8192, "max_num_tokens": 8192, "max_batch_size": 8,
                               "kv_cache_config": {"max_tokens": 16384, "tokens_per_block": 32, "dtype": kv_dtype},
                               "cache_transceiver_config": {"kv_transfer_timeout_ms": 120000}}))
    env = {**os.environ, "PDSERVE_AUTH_TOKEN": TOKEN, "HF_HUB_OFFLINE": "1"}  # the token one_handoff sends
    log = open(cfg.with_suffix(".log"), "w")
    return subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--config", str(cfg), "--role", role],
                            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def handoff_figures(workdir: Path, model: Path, repeats: int, prompt_len: int = 4096) -> None:
    """One pair at a time (two 8B pairs at once do not fit an 80 GB GPU), the same prompts through
    each (one warm-up each: the handshake, IPC handles)."""
    rng = torch.Generator().manual_seed(1)
    prompts = [torch.randint(10, 500, (prompt_len,), generator=rng).tolist() for _ in range(repeats + 1)]
    runs: dict[str, list[dict]] = {}
    transfers = {}
    for d in DTYPES:
        procs = {role: start_server(workdir, model, role, d) for role in ("context", "generation")}
        url = {role: f"http://127.0.0.1:{PORTS[d][role == 'generation']}" for role in procs}
        try:
            for role, proc in procs.items():
                wait_healthy(url[role], proc)
            runs[d] = [one_handoff(url["context"], url["generation"], p) for p in prompts][1:]
            transfers[d] = metric(url["generation"], "pdserve_kv_transfer_seconds_count")
        finally:
            for proc in procs.values():
                proc.terminate()
            for proc in procs.values():
                proc.wait(timeout=60)
    med = {d: {f: statistics.median(r[f] for r in runs[d]) for f in ("bytes", "handoff_s", "context_leg_s")}
           for d in DTYPES}
    record("handoff", prompt_tokens=prompt_len, bf16_bytes=med["auto"]["bytes"], fp8_bytes=med["fp8"]["bytes"],
           bf16_ms=1000 * med["auto"]["handoff_s"], fp8_ms=1000 * med["fp8"]["handoff_s"],
           bytes_ratio=med["fp8"]["bytes"] / med["auto"]["bytes"],
           time_ratio=med["fp8"]["handoff_s"] / med["auto"]["handoff_s"],
           context_leg_ms={d: 1000 * med[d]["context_leg_s"] for d in DTYPES}, transfers=transfers,
           runs_ms={d: [round(1000 * r["handoff_s"], 2) for r in runs[d]] for d in DTYPES},
           goal="bytes 0.5x, time <= 0.6x")


def host_hit_ms(model: Path, args: argparse.Namespace, kv_dtype: str) -> tuple[float, ...]:
    """(miss, GPU hit, host hit) TTFT of a 4k prompt and the bytes its host hit onboarded, medians
    of 3 cycles (bench_gpu's host tier)."""
    core, _ = make_core(model, args, {"max_tokens": 5 * 4096, "host_cache_size": 4 << 30, "dtype": kv_dtype})
    cycles = []
    for _ in range(3):
        a = prompt(4096)
        miss, gpu_hit = ttft_ms(core, a), ttft_ms(core, a)
        for _ in range(5):
            ttft_ms(core, prompt(4096))
        before = core.kv.stats().bytes_onboarded
        host = ttft_ms(core, a)
        cycles.append((miss, gpu_hit, host, core.kv.stats().bytes_onboarded - before))
    del core
    torch.cuda.empty_cache()
    return tuple(statistics.median(c[i] for c in cycles) for i in range(4))


def long_decode_tok_s(model: Path, args: argparse.Namespace, kv_dtype: str) -> float:
    """64 requests of 2,048-token prompts decoding together: median over repeats of the decode-only
    steps' tok/s."""
    core, _ = make_core(model, args, {"max_tokens": 64 * (2048 + 64), "dtype": kv_dtype})
    rates = []
    for _ in range(args.repeats):
        for _ in range(64):
            submit(core, prompt(2048), 32)
        _, steps = drive(core)
        decode = [(s, n) for s, n, d in steps if d]
        rates.append(sum(n for _, n in decode) / sum(s for s, _ in decode))
    del core
    torch.cuda.empty_cache()
    return statistics.median(rates)


def engine_figures(model: Path, args: argparse.Namespace) -> None:
    hits = {d: host_hit_ms(model, args, d) for d in DTYPES}
    record("host_tier_hit_4k", bf16_ms=hits["auto"][2], fp8_ms=hits["fp8"][2],
           ratio=hits["fp8"][2] / hits["auto"][2], miss_ms={d: hits[d][0] for d in DTYPES},
           gpu_hit_ms={d: hits[d][1] for d in DTYPES}, onboarded_bytes={d: hits[d][3] for d in DTYPES},
           goal="<= 0.6")
    rates = {d: long_decode_tok_s(model, args, d) for d in DTYPES}
    record("decode_b64_2048", bf16_tok_s=rates["auto"], fp8_tok_s=rates["fp8"], ratio=rates["fp8"] / rates["auto"],
           goal=">= 1.3")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/bench-gpu"))
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip", default="", help="comma-separated: handoff,engine")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    args.kernels, args.no_graphs, args.max_num_tokens = "auto", False, 8192  # what bench_gpu.make_core reads
    skip = set(filter(None, args.skip.split(",")))
    torch.manual_seed(0)
    ceilings()
    start = time.perf_counter()
    args.workdir.mkdir(parents=True, exist_ok=True)
    model = build_model(args.workdir / f"llama8b-shaped-{args.layers}", args.layers)
    record("model", dir=str(model), build_s=time.perf_counter() - start)
    if "handoff" not in skip:
        handoff_figures(args.workdir, model, args.repeats)
    if "engine" not in skip:
        engine_figures(model, args)
    record("total", seconds=time.perf_counter() - start)
    print("SUMMARY " + json.dumps(RESULTS), flush=True)
    if args.out:
        args.out.write_text("".join(json.dumps(r) + "\n" for r in RESULTS))


if __name__ == "__main__":
    main()
