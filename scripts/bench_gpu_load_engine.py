"""Phase a of scripts/bench_gpu_load.py, in a process of its own (its GPU memory is all freed when it
exits, before the servers start): the engine-level ceilings the HTTP figures are divided by.

Builds (once) the 8B-shaped model with a text-only lm_head (`build_model(..., text_tokens=512)`),
or takes `--model` (e.g. `builtin:tiny-llama` on a CPU), measures the memory read rate (HBM on a GPU:
`bench_gpu.ceilings`, with pinned host->device and bf16 GEMM), builds the engine as `pdserve serve`
does and drives `EngineCore` without HTTP (`bench_gpu.submit` / `drive`):
- b1 TPOT (INPUT in / OUTPUT out), and the bytes one b1 step reads (weights + the mean context's KV);
- c=C decode: output tok/s over the decode-only steps and their median step time;
- with `--prefill-len N` (phase f): TTFT of an N-token prompt (median of 3) and its model TFLOP/s.
Prints `ENGINE {json}` as its last line.

    python scripts/bench_gpu_load_engine.py --model-dir /tmp/bench-gpu/llama8b-text-32 --layers 32
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from bench_gpu import ceilings, drive, model_flops, replay_ms, submit, weight_bytes

from pdserve_bench.gpu_handoff import build_model
from server.config.schema import server_config_from_dict
from server.engine.core import EngineCore
from server.engine_host.build import build_core
from server.models.builtin import resolve_model
from server.telemetry.metrics import ServerMetrics

TEXT_TOKENS = 512  # the tiny tokenizer's size: prompt ids are drawn from [10, 500)


def prompt(n: int) -> list[int]:
    return torch.randint(10, 500, (n,)).tolist()


def memory_ceilings() -> dict[str, float]:
    """HBM read GB/s (+ pinned H2D, GEMM) on a GPU; on a CPU the RAM read rate of `x.sum()` over 256 MiB."""
    if torch.cuda.is_available():
        return ceilings()
    x = torch.empty(64 << 20, dtype=torch.float32).normal_()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return {"hbm_read_gb_s": x.numel() * 4 / best / 1e9}


def make_core(model: str, args: argparse.Namespace) -> tuple[EngineCore, float]:
    cfg = server_config_from_dict({
        "model": model, "max_seq_len": args.max_seq_len, "max_num_tokens": args.max_num_tokens,
        "max_batch_size": args.max_batch_size, "kv_cache_config": {"tokens_per_block": 32},
        "cache_transceiver_config": {"auth_token": "bench-gpu-load-token-0123456789"}}, "bench_gpu_load")
    start = time.perf_counter()
    core = build_core(cfg, ServerMetrics())
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return core, time.perf_counter() - start


def decode_figures(core: EngineCore, args: argparse.Namespace) -> dict[str, float]:
    rid = submit(core, prompt(args.input_len), args.output_len)
    times, _ = drive(core)
    tokens = times[rid]
    b1 = (tokens[-1] - tokens[1]) / (len(tokens) - 2) * 1000
    for _ in range(args.concurrency):
        submit(core, prompt(args.input_len), args.output_len)
    _, steps = drive(core)
    decode = [(s, n) for s, n, only_decode in steps if only_decode]
    kv_step = core.kv.layout.bytes_per_token() * (args.input_len + args.output_len / 2)
    return {"tpot_b1_engine_ms": b1, "weight_bytes": float(weight_bytes(core)), "b1_kv_bytes": kv_step,
            "engine_tok_s": sum(n for _, n in decode) / sum(s for s, _ in decode),
            "engine_step_ms": statistics.median(s for s, _ in decode) * 1000,
            "engine_replay_ms": replay_ms(core, args.concurrency), "decode_steps": float(len(decode))}


def closed_loop_figures(core: EngineCore, args: argparse.Namespace) -> dict[str, float]:
    """Phase c's workload without HTTP: C requests in flight, each finished one replaced by a new one.

    The first wave's lengths are staggered (as the HTTP client's ramp staggers them) so arrivals spread
    over the steps; tok/s and the median step are taken after the first wave has drained.
    """
    n, out_len = args.concurrency, args.output_len
    for i in range(n):
        submit(core, prompt(args.input_len), max(1, out_len * (i + 1) // n))
    counted, start, steps, step_times = 0, 0.0, 0, []
    while steps < 3 * out_len:
        t0 = time.perf_counter()
        outputs = core.step()
        step_times.append(time.perf_counter() - t0)
        steps += 1
        if steps == out_len:
            counted, start, step_times = 0, time.perf_counter(), []
        counted += sum(len(o.new_token_ids) for o in outputs)
        for _ in (o for o in outputs if o.finished):
            submit(core, prompt(args.input_len), out_len)
    tok_s = counted / (time.perf_counter() - start)
    while core.has_work():
        core.step()
    return {"engine_closed_tok_s": tok_s, "engine_closed_step_ms": statistics.median(step_times) * 1000}


def prefill_figures(core: EngineCore, args: argparse.Namespace) -> dict[str, float]:
    def ttft_ms() -> float:
        start = time.perf_counter()
        rid = submit(core, prompt(args.prefill_len), 1)
        return (drive(core)[0][rid][0] - start) * 1000

    ttft_ms()  # a prompt length this process has not seen yet
    steady = statistics.median(ttft_ms() for _ in range(3))
    # model FLOPs of the 8B shapes: meaningless for another --model
    tflop_s = model_flops(args.layers, args.prefill_len) / steady / 1e9 if args.model is None else float("nan")
    return {"prefill_ttft_ms": steady, "prefill_tflop_s": tflop_s, "prefill_mfu_989": tflop_s / 989}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", type=Path, help="where the 8B-shaped model is (built there once)")
    parser.add_argument("--model", help="serve this model instead of the 8B-shaped one (smoke runs)")
    parser.add_argument("--build-only", action="store_true", help="only build the model and say where it is")
    for name, default in (("layers", 32), ("max-seq-len", 8192), ("max-num-tokens", 8192), ("max-batch-size", 64),
                          ("input-len", 128), ("output-len", 256), ("concurrency", 64), ("prefill-len", 0)):
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args()
    torch.manual_seed(0)
    out: dict[str, object] = {} if args.build_only else memory_ceilings()
    start = time.perf_counter()
    model = args.model or str(build_model(args.model_dir, args.layers, text_tokens=TEXT_TOKENS))
    out |= {"model": model, "model_path": str(resolve_model(model)), "build_s": time.perf_counter() - start}
    if args.build_only:
        print("ENGINE " + json.dumps(out), flush=True)
        return
    core, out["engine_startup_s"] = make_core(model, args)
    out |= decode_figures(core, args)
    out |= closed_loop_figures(core, args)
    if args.prefill_len:
        out |= prefill_figures(core, args)
    print("ENGINE " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
