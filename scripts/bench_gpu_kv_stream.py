"""Streamed KV figure on one GPU: a 16k-token prompt through a disaggregated pair
(router + context + generation server on the same GPU, `pdserve launch`) of the 8B-shaped model
(`pdserve_bench.gpu_handoff.build_model`, its positions raised to 32k), KV streamed while it is
prefilled (`kv_stream: on`) against the whole prompt sent after the prefill (`kv_stream: off`).

Per deployment, medians of `--repeats` fresh prompts (no prefix hit):
- context leg alone: a request for 1 token (the context server answers it itself);
- pair: a request for 2 tokens (the context server's first token, then one decoded by the
  generation server from the pulled KV): its time until the generation server had the KV, plus
  one decode step.
Goal: streamed pair <= 1.05x its context leg alone.

    python scripts/bench_gpu_kv_stream.py --workdir /tmp/bench-gpu [--layers 32] [--prompt 16384] [--chunk 2048]

Prints one JSON line per deployment and a SUMMARY line; `--out FILE` also writes them as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from bench_gpu_serving import launch, metric, stop, stream

from pdserve_bench.gpu_handoff import build_model

TOKEN = "bench-gpu-kv-stream-token-0123456789"
VOCAB = 500  # prompt ids below this (the 8B-shaped model keeps the tiny tokenizer)


def model_32k(workdir: Path, layers: int) -> Path:
    """The 8B-shaped model with max_position_embeddings 32768 (RoPE takes any position)."""
    out = build_model(workdir / f"llama8b-shaped-{layers}-32k", layers)
    config = json.loads((out / "config.json").read_text())
    if config.get("max_position_embeddings") != 32768:
        config["max_position_embeddings"] = 32768
        (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def deployment(model: Path, prompt: int, chunk: int, kv_stream: str) -> dict:
    return {"model": str(model), "hostname": "127.0.0.1", "port": 18900, "max_seq_len": prompt + 64,
            "max_num_tokens": chunk, "max_batch_size": 8, "kv_cache_config": {"tokens_per_block": 32},
            "cache_transceiver_config": {"auth_token": TOKEN, "kv_transfer_timeout_ms": 120000},
            "context_servers": {"num_instances": 1, "urls": ["127.0.0.1:18901"], "kv_stream": kv_stream},
            "generation_servers": {"num_instances": 1, "urls": ["127.0.0.1:18902"]}}


def measure(url: str, prompt: int, repeats: int, rng: torch.Generator) -> dict[str, float]:
    fresh = lambda: torch.randint(10, VOCAB, (prompt,), generator=rng).tolist()  # noqa: E731
    stream(url, fresh(), 2)  # warm-up: connections, the first long prefill, the first pull
    alone = [stream(url, fresh(), 1)[0] for _ in range(repeats)]
    pair = [stream(url, fresh(), 2)[0] for _ in range(repeats)]
    a, p = statistics.median(alone), statistics.median(pair)
    return {"context_leg_ms": a * 1000, "pair_ms": p * 1000, "pair_over_context": p / a,
            "streamed_transfers": metric("http://127.0.0.1:18902", "pdserve_kv_transfer_streamed_total")}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/bench-gpu"))
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=16384)
    parser.add_argument("--chunk", type=int, default=2048, help="max_num_tokens: the prefill step")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--model", help="serve this model instead of the 8B-shaped one (smoke runs on a CPU)")
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.model:
        from server.models.builtin import resolve_model

        model = resolve_model(args.model)
    else:
        model = model_32k(args.workdir, args.layers)
    rng = torch.Generator().manual_seed(21)
    results = {}
    for kv_stream in ("on", "off"):
        start = time.perf_counter()
        proc = launch(deployment(model, args.prompt, args.chunk, kv_stream), args.workdir, f"kv_stream_{kv_stream}")
        try:
            figures = measure("http://127.0.0.1:18900", args.prompt, args.repeats, rng)
        finally:
            stop(proc)
        results[kv_stream] = record = {"figure": "kv_stream", "kv_stream": kv_stream, "prompt_tokens": args.prompt,
                                       "chunk": args.chunk, "layers": args.layers, **figures,
                                       "wall_s": time.perf_counter() - start}
        print(json.dumps(record), flush=True)
        if args.out is not None:
            with args.out.open("a") as f:
                f.write(json.dumps(record) + "\n")
    on, off = results["on"], results["off"]
    print(f"SUMMARY kv_stream {args.prompt} tokens: streamed pair {on['pair_ms']:.1f} ms = "
          f"{on['pair_over_context']:.3f}x its context leg ({on['context_leg_ms']:.1f} ms; goal <= 1.05x); "
          f"whole-prompt pair {off['pair_ms']:.1f} ms = {off['pair_over_context']:.3f}x "
          f"({off['context_leg_ms']:.1f} ms)")


if __name__ == "__main__":
    main()
