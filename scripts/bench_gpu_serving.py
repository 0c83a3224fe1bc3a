"""GPU figures that need the servers: `pdserve launch` deployments of the 8B-shaped
model, measured over HTTP with streaming (time to the first SSE event, token gaps).

For each deployment, aggregated (router + 1 aggregated server) and disaggregated (router + context +
generation server on the same GPU), launched one after the other:
- prefix-hit TTFT: a 4,096-token prompt sent once (miss), then again (4,095 tokens cached), median
  of `--repeats` fresh prompts; the disaggregated figure against the aggregated one (goal <= 1.2x);
- batch-1 TPOT as served (128 in / 256 out, streamed);
- the KV handoff of the disaggregated pair against its context leg (goal <= 5%), from the servers'
  own metrics (`pdserve_kv_transfer_seconds`) and the router's leg latency when it reports one.

    python scripts/bench_gpu_serving.py --workdir /tmp/bench-gpu [--layers 32]
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

import httpx
import torch
import yaml

from pdserve_bench.gpu_handoff import build_model
from pdserve_bench.launch import wait_for_health

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "bench-gpu-serving-token-0123456789"
PHASES = ("wait", "apply", "rest")  # pdserve_kv_transfer_phase_seconds_total{phase}
VOCAB = 500  # prompt token ids are drawn below this (the 8B-shaped model keeps the tiny tokenizer)


def deployment(model: Path, disaggregated: bool) -> dict:
    cfg = {"model": str(model), "hostname": "127.0.0.1", "port": 18900, "max_seq_len": 8192,
           "max_num_tokens": 8192, "max_batch_size": 64, "kv_cache_config": {"tokens_per_block": 32},
           "cache_transceiver_config": {"auth_token": TOKEN, "kv_transfer_timeout_ms": 120000}}
    if disaggregated:
        cfg["context_servers"] = {"num_instances": 1, "urls": ["127.0.0.1:18901"]}
    cfg["generation_servers"] = {"num_instances": 1, "urls": ["127.0.0.1:18902"]}
    return cfg


def launch(cfg: dict, workdir: Path, name: str) -> subprocess.Popen:
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    log = open(workdir / f"{name}.launch.log", "w")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "server.cli", "launch", str(path), "--log-dir",
                             str(workdir / f"{name}-logs")], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    if not wait_for_health("http://127.0.0.1:18900", 600, lambda: proc.poll() is None, interval_s=1.0):
        raise SystemExit(f"{name} did not become healthy:\n{(workdir / f'{name}.launch.log').read_text()[-3000:]}")
    return proc


def stream(url: str, prompt: list[int], max_tokens: int) -> tuple[float, list[float]]:
    """(seconds until the whole answer of `max_tokens` tokens is back, []): not streamed, because the
    8B-shaped model's tokens decode to no text under the tiny tokenizer, and SSE sends only text."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    start = time.perf_counter()
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == max_tokens
    return time.perf_counter() - start, []


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")
               or line.startswith(name + "{"))


def measure(url: str, repeats: int, rng: torch.Generator, pair: tuple[str, str] | None) -> dict[str, float]:
    """Misses first (with the pair's handoff and context-leg time over just those), then hits of
    the same prompts, then a streamed b1 decode."""
    prompts = [torch.randint(10, min(30000, VOCAB), (4096,), generator=rng).tolist() for _ in range(repeats + 1)]
    fresh = [torch.randint(10, min(30000, VOCAB), (4096,), generator=rng).tolist() for _ in range(repeats)]
    out: dict[str, float] = {}
    stream(url, prompts[0], 2)  # warm-up: connections, first request
    misses = [stream(url, p, 1)[0] for p in prompts[1:]]  # TTFT: an answer of one token (context leg only)
    before = _pair_metrics(pair)
    for p in fresh:  # two tokens: the generation leg runs and pulls the prompt's KV
        stream(url, p, 2)
    after = _pair_metrics(pair)
    hits = [stream(url, p, 1)[0] for p in prompts[1:]]
    if pair is not None:
        n = after["transfers"] - before["transfers"]
        out["handoff_ms_mean"] = (after["transfer_s"] - before["transfer_s"]) / max(1, n) * 1000
        out["context_leg_ms_mean"] = (after["ctx_ttft_s"] - before["ctx_ttft_s"]) / max(1, n) * 1000
        for phase in PHASES:  # where the handoff's time goes (the receiver's own split)
            out[f"handoff_{phase}_ms_mean"] = (after[phase] - before[phase]) / max(1, n) * 1000
    prompt = torch.randint(10, min(30000, VOCAB), (128,), generator=rng).tolist()
    one, _ = stream(url, prompt, 1)
    many, _ = stream(url, prompt + [7], 257)
    return {"miss_ttft_ms": statistics.median(misses) * 1000, "prefix_hit_ttft_ms": statistics.median(hits) * 1000,
            "tpot_b1_ms": (many - one) / 256 * 1000, **out}


def _pair_metrics(pair: tuple[str, str] | None) -> dict[str, float]:
    if pair is None:
        return {}
    ctx, gen = pair
    return {"transfers": metric(gen, "pdserve_kv_transfer_seconds_count"),
            "transfer_s": metric(gen, "pdserve_kv_transfer_seconds_sum"),
            "ctx_ttft_s": metric(ctx, "pdserve_time_to_first_token_seconds_sum"),
            **{phase: metric(gen, f'pdserve_kv_transfer_phase_seconds_total{{phase="{phase}"}}') for phase in PHASES}}


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/bench-gpu"))
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", help="serve this model instead of building the 8B-shaped one (smoke runs)")
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.model:
        from server.models.builtin import resolve_model

        model = resolve_model(args.model)
    else:
        model = build_model(args.workdir / f"llama8b-shaped-{args.layers}", args.layers)
    rng = torch.Generator().manual_seed(2)
    results = {}
    for name, disagg in (("aggregated", False), ("disaggregated", True)):
        start = time.perf_counter()
        proc = launch(deployment(model, disagg), args.workdir, name)
        pair = ("http://127.0.0.1:18901", "http://127.0.0.1:18902") if disagg else None
        launched_s = time.perf_counter() - start
        results[name] = {"launch_s": launched_s, **measure("http://127.0.0.1:18900", args.repeats, rng, pair)}
        print(json.dumps({"deployment": name, **results[name]}), flush=True)
        stop(proc)
    agg, dis = results["aggregated"], results["disaggregated"]
    summary = {"prefix_hit_disagg_vs_agg": dis["prefix_hit_ttft_ms"] / agg["prefix_hit_ttft_ms"],
               "handoff_vs_context_leg": dis["handoff_ms_mean"] / dis["context_leg_ms_mean"],
               "goals": "prefix hit <= 1.2x aggregated; handoff <= 5% of the context leg"}
    print("SUMMARY " + json.dumps({**results, **summary}), flush=True)


if __name__ == "__main__":
    main()
