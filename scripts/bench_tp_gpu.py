"""Tensor-parallel figures on GPUs, on the Llama-3.1-8B-shaped random bf16 model.

- agreement: greedy tokens of TP=2 and TP=4 (as many as the GPUs allow) against TP=1 over 64 new
  tokens for a few prompts: tokens equal, and where the first difference is (bf16 sums of partial
  projections round differently from one GEMM, so an exact match is not guaranteed);
- tpot: batch-1 TPOT (128 in / 256 out) of each size, and TP=N / TP=1 (goal: <= 0.65 at TP=2);
- handoff: a context server TP=2 and a generation server TP=1 (`pdserve serve` each, the context on
  GPUs 0,1 and the generation on the next GPU, or on GPU 0 with only two): the KV handoff time
  and bytes of a 4,096-token prompt, bytes per context rank (each sends its kv heads' share).

Each size runs in its own process (`--size N`: one engine built as `pdserve serve` builds it, rank 0
here and N - 1 spawned ranks). One GPU: `--figures tpot --sizes 1` on two checkouts is the TP=1
regression check (b1 TPOT and c=64 within 3%; add `--c64`).

    python scripts/bench_tp_gpu.py --workdir /tmp/bench-tp [--layers 32] [--sizes 1,2,4] \
        [--figures agreement,tpot,handoff] [--out results.jsonl]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
PROMPT_SEEDS = (1, 2, 3)
NEW_TOKENS = 64


def engine_run(model_dir: Path, size: int, c64: bool) -> dict:
    """In this process: build the engine of `size` ranks, greedy tokens and TPOT."""
    from server.config.schema import server_config_from_dict
    from server.engine_host.build import build_core
    from server.telemetry.metrics import ServerMetrics
    from server.types import GenerateRequest, SamplingParams

    kv_tokens = 64 * 4096 if torch.cuda.is_available() else 8192  # the CPU: a smoke run on a tiny model
    cfg = server_config_from_dict({
        "model": str(model_dir), "max_seq_len": 4096, "max_num_tokens": 4096, "max_batch_size": 64,
        "tensor_parallel_size": size, "kv_cache_config": {"tokens_per_block": 32, "max_tokens": kv_tokens},
        "cache_transceiver_config": {"auth_token": "bench-tp-token-0123456789"}}, "bench_tp_gpu")
    core = build_core(cfg, ServerMetrics())

    def run(prompts: list[list[int]], max_tokens: int) -> dict[str, tuple[list[int], list[float]]]:
        ids = []
        for p in prompts:
            ids.append(uuid.uuid4().hex)
            core.add_request(GenerateRequest(ids[-1], p, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                        ignore_eos=True)))
        out: dict[str, tuple[list[int], list[float]]] = {i: ([], []) for i in ids}
        while core.has_work():
            for o in core.step():
                now = time.perf_counter()
                out[o.request_id][0].extend(o.new_token_ids)
                out[o.request_id][1].extend([now] * len(o.new_token_ids))
        return {i: out[i] for i in ids}

    gen, high = torch.Generator().manual_seed(0), min(30000, core.runner.spec.vocab_size)
    prompts = [torch.randint(10, high, (128,), generator=torch.Generator().manual_seed(s)).tolist()
               for s in PROMPT_SEEDS]
    tokens = [t for t, _ in run(prompts, NEW_TOKENS).values()]
    run([prompts[0]], 16)  # warm
    [(_, times)] = run([torch.randint(10, high, (128,), generator=gen).tolist()], 256).values()
    result = {"size": size, "tokens": tokens, "tpot_b1_ms": (times[-1] - times[1]) / (len(times) - 2) * 1000}
    if c64:
        start = time.perf_counter()
        done = run([torch.randint(10, high, (128,), generator=gen).tolist() for _ in range(64)], 256)
        result["c64_tok_s"] = sum(len(t) for t, _ in done.values()) / (time.perf_counter() - start)
    ranks = getattr(core.runner, "ranks", None)
    if ranks is not None:
        ranks.stop()
    return result


def sizes_run(args: argparse.Namespace, model_dir: Path) -> list[dict]:
    out = []
    for size in args.sizes:
        if size > torch.cuda.device_count():
            print(json.dumps({"figure": "skipped", "size": size, "gpus": torch.cuda.device_count()}), flush=True)
            continue
        cmd = [sys.executable, __file__, "--size", str(size), "--model-dir", str(model_dir)]
        cmd += ["--c64"] if args.c64 else []
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=3600)
        if done.returncode != 0:
            raise SystemExit(f"size {size} failed:\n{done.stderr[-4000:]}")
        out.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return out


def agreement(runs: list[dict]) -> list[dict]:
    base = next(r for r in runs if r["size"] == 1)["tokens"]
    rows = []
    for r in runs:
        firsts = [next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), None)
                  for x, y in zip(r["tokens"], base, strict=True)]
        rows.append({"figure": "agreement", "size": r["size"], "equal": r["tokens"] == base,
                     "first_difference": firsts, "new_tokens": NEW_TOKENS})
    return rows


def tpot(runs: list[dict]) -> list[dict]:
    one = next(r for r in runs if r["size"] == 1)
    return [{"figure": "tpot_b1", "size": r["size"], "tpot_ms": r["tpot_b1_ms"],
             "vs_tp1": r["tpot_b1_ms"] / one["tpot_b1_ms"], "c64_tok_s": r.get("c64_tok_s"),
             "goal": "TP=2 <= 0.65 x TP=1"} for r in runs]


def handoff(args: argparse.Namespace, model_dir: Path) -> dict:
    """A context server TP=2 and a generation server TP=1, as `pdserve-bench gpu-handoff` drives them."""
    from pdserve_bench import gpu_handoff as gh

    gen_gpu = "2" if torch.cuda.device_count() > 2 else "0"
    servers = [_serve(args.workdir, model_dir, "context", 18801, "0,1", 2),
               _serve(args.workdir, model_dir, "generation", 18802, gen_gpu, 1)]
    ctx, gen = "http://127.0.0.1:18801", "http://127.0.0.1:18802"
    try:
        for url, proc in zip((ctx, gen), servers, strict=True):
            gh.wait_healthy(url, proc)
        rng = torch.Generator().manual_seed(1)
        results = [gh.one_handoff(ctx, gen, torch.randint(10, 500, (4096,), generator=rng).tolist())
                   for _ in range(4)][1:]  # the first is a warm-up
    finally:
        for proc in servers:
            proc.terminate()
        for proc in servers:
            proc.wait(timeout=60)
    med = sorted(results, key=lambda r: r["handoff_s"])[len(results) // 2]
    return {"figure": "handoff_ctx_tp2_gen_tp1", "prompt_tokens": 4096, "handoff_s_median": med["handoff_s"],
            "bytes": med["bytes"], "bytes_per_context_rank": med["bytes"] / 2, "gb_s": med["handoff_gb_s"],
            "generation_gpu": gen_gpu, "runs": results}


def _serve(workdir: Path, model: Path, role: str, port: int, gpus: str, tp: int) -> subprocess.Popen:
    from pdserve_bench import gpu_handoff as gh

    cfg = workdir / f"{role}.yaml"
    peers = {"context_urls": [gh.CONTEXT_URL]} if role == "generation" else {}
    cfg.write_text(json.dumps({**peers, "model": str(model), "hostname": "127.0.0.1", "port": port,
                               "max_seq_len": 8192, "max_num_tokens": 8192, "max_batch_size": 8,
                               "tensor_parallel_size": tp,
                               "kv_cache_config": {"max_tokens": 16384, "tokens_per_block": 32},
                               "cache_transceiver_config": {"kv_transfer_timeout_ms": 120000}}))
    env = {**os.environ, "PDSERVE_AUTH_TOKEN": gh.TOKEN, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": gpus}
    log = open(workdir / f"{role}.log", "w")  # noqa: SIM115 (the server's log, for its life)
    return subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--config", str(cfg), "--role", role],
                            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/bench-tp"))
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4])
    parser.add_argument("--figures", default="agreement,tpot,handoff")
    parser.add_argument("--c64", action="store_true", help="also c=64 decode tok/s per size")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--size", type=int, help=argparse.SUPPRESS)  # one size, in this process
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.size is not None:
        print(json.dumps(engine_run(args.model_dir, args.size, args.c64)), flush=True)
        return
    from pdserve_bench.gpu_handoff import build_model

    args.workdir.mkdir(parents=True, exist_ok=True)
    model_dir = build_model(args.workdir / f"llama8b-shaped-{args.layers}", args.layers)
    figures, rows = set(args.figures.split(",")), []
    if figures & {"agreement", "tpot"}:
        runs = sizes_run(args, model_dir)
        rows += (agreement(runs) if "agreement" in figures else []) + (tpot(runs) if "tpot" in figures else [])
    if "handoff" in figures and torch.cuda.device_count() >= 2:
        rows.append(handoff(args, model_dir))
    for row in rows:
        print(json.dumps(row), flush=True)
    print("SUMMARY " + json.dumps(rows), flush=True)
    if args.out:
        args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
