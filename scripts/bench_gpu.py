"""GPU fast-path figures, engine level, in one process: the ceilings first, then ratios.

Builds (once) a random-weight bfloat16 model with Llama-3.1-8B dimensions (`pdserve_bench.
gpu_handoff.build_model`), builds the engine exactly as `pdserve serve` does
(`server.engine_host.build.build_core`: weights, KV pool, runner warm-up with graph capture) and
drives `EngineCore` directly (no HTTP):

- ceilings measured in the same run: HBM read GB/s (`x.sum()` over 4 GiB, median of 20), pinned
  host->device GB/s, bf16 GEMM TFLOP/s;
- batch-1 TPOT (128 in / 256 out, greedy) against bytes read per step / HBM and against the CUDA
  graph replay time of the same forward;
- c=64 decode output tok/s (128 in / 256 out) against 64 / (GPU time of one b64 step);
- both of these with async scheduling off and on (`EngineCore.async_scheduling`, switched between
  runs of the same engine, alternating, twice each) and the ratio of their medians;
- long context: decode step time at batch 64 with 2,048-token contexts against
  (weights + KV bytes read) / HBM;
- 4,096-token prefill (cache miss): TTFT and TFLOP/s (model FLOPs: 2 x params x tokens + causal
  attention), and the first such request after start against the steady state;
- host tier: a 4,096-token prompt evicted to the host pool and hit again, TTFT against a miss and a
  GPU hit, onboard GB/s against pinned H2D.

    python scripts/bench_gpu.py --workdir /tmp/bench-gpu [--layers 32] [--kernels triton|torch]

Prints one JSON line per figure and a SUMMARY line; `--out FILE` also writes them as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid
from pathlib import Path

import torch

from pdserve_bench.gpu_handoff import LLAMA_8B, build_model
from server.config.schema import server_config_from_dict
from server.engine.core import EngineCore
from server.engine_host.build import build_core
from server.telemetry.metrics import ServerMetrics
from server.types import GenerateRequest, SamplingParams

RESULTS: list[dict] = []


def record(name: str, **figures: object) -> None:
    row = {"figure": name, **figures}
    RESULTS.append(row)
    print(json.dumps(row), flush=True)


# ---- ceilings ------------------------------------------------------------------------------------

def timed_ms(fn, repeats: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def ceilings() -> dict[str, float]:
    big = torch.empty(2 << 30, dtype=torch.bfloat16, device="cuda").normal_()  # 4 GiB
    hbm = big.numel() * 2 / timed_ms(big.sum) / 1e6
    del big
    host = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    h2d = host.numel() / timed_ms(lambda: dev.copy_(host, non_blocking=True), repeats=5) / 1e6
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    gemm = 2 * 8192**3 / timed_ms(lambda: a @ a, repeats=10) / 1e9
    out = {"hbm_read_gb_s": hbm, "pinned_h2d_gb_s": h2d, "bf16_gemm_tflop_s": gemm}
    record("ceilings", **out)
    return out


# ---- the engine ----------------------------------------------------------------------------------

def make_core(model_dir: Path, args: argparse.Namespace, kv: dict) -> tuple[EngineCore, float]:
    cfg = server_config_from_dict({
        "model": str(model_dir), "max_seq_len": 8192, "max_num_tokens": args.max_num_tokens,
        "max_batch_size": 64, "kernels": args.kernels, "cuda_graphs": not args.no_graphs,
        "dtype": getattr(args, "dtype", "auto"),
        "kv_cache_config": {"tokens_per_block": 32, **kv},
        "cache_transceiver_config": {"auth_token": "bench-gpu-token-0123456789"}}, "bench_gpu")
    start = time.perf_counter()
    core = build_core(cfg, ServerMetrics())
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return core, time.perf_counter() - start


def prompt(n: int) -> list[int]:
    return torch.randint(10, 30000, (n,)).tolist()


def submit(core: EngineCore, prompt_ids: list[int], max_tokens: int) -> str:
    rid = uuid.uuid4().hex
    core.add_request(GenerateRequest(rid, prompt_ids, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                     ignore_eos=True)))
    return rid


def drive(core: EngineCore) -> tuple[dict[str, list[float]], list[tuple[float, int, bool]]]:
    """Step until idle: token times per request, and (seconds, tokens, decode-only) per step."""
    times: dict[str, list[float]] = {}
    steps = []
    while core.has_work():
        decode_only = bool(core.scheduler.running) and not core.scheduler.waiting and all(
            r.num_computed_tokens + 1 == r.num_tokens for r in core.scheduler.running)
        start = time.perf_counter()
        outputs = core.step()
        now = time.perf_counter()
        steps.append((now - start, sum(len(o.new_token_ids) for o in outputs), decode_only))
        for o in outputs:
            times.setdefault(o.request_id, []).extend([now] * len(o.new_token_ids))
    return times, steps


def ttft_ms(core: EngineCore, prompt_ids: list[int]) -> float:
    start = time.perf_counter()
    rid = submit(core, prompt_ids, 1)
    times, _ = drive(core)
    return (times[rid][0] - start) * 1000


def replay_ms(core: EngineCore, batch: int) -> float:
    graphs = core.runner.graphs
    if graphs is None or batch not in graphs.graphs:
        return float("nan")
    return timed_ms(graphs.graphs[batch].replay, repeats=50)


def weight_bytes(core: EngineCore) -> int:
    """The bytes of every weight tensor a decode step reads: the layers (their MLP, expert and attention
    objects included), the final norm and the LM head; of the embedding table a step reads one row."""
    model = core.runner.model
    seen: tuple[set[int], set[int]] = (set(), set())
    return sum(_tensor_bytes(v, seen) for v in [model.final_norm, model.lm_head, *model.layers])


def _tensor_bytes(value: object, seen: tuple[set[int], set[int]]) -> int:
    """Bytes of the tensors reachable from `value` through attributes, lists and dicts, each storage once."""
    storages, objects = seen
    if isinstance(value, torch.Tensor):  # integer tensors are counters and indices, not weights
        if not value.is_floating_point() or value.data_ptr() in storages:
            return 0
        storages.add(value.data_ptr())
        return value.numel() * value.element_size()
    if id(value) in objects or isinstance(value, (str, bytes, int, float, bool, type(None))):
        return 0
    objects.add(id(value))
    if isinstance(value, dict):
        items = value.values()
    elif isinstance(value, (list, tuple)):
        items = value
    else:
        items = vars(value).values() if hasattr(value, "__dict__") else ()
    return sum(_tensor_bytes(v, seen) for v in items)


def model_flops(layers: int, tokens: int) -> float:
    h, i, kvd = LLAMA_8B["hidden_size"], LLAMA_8B["intermediate_size"], LLAMA_8B["num_key_value_heads"] * 128
    per_token = 2 * layers * (h * h * 2 + 2 * h * kvd + 3 * h * i) + 2 * h * LLAMA_8B["vocab_size"] / tokens
    attention = 2 * 2 * layers * h * tokens * tokens / 2  # QK^T and PV, causal half
    return per_token * tokens + attention


def tpot_b1_ms(core: EngineCore) -> float:
    rid = submit(core, prompt(128), 256)
    times, _ = drive(core)
    return (times[rid][-1] - times[rid][1]) / (len(times[rid]) - 2) * 1000


def decode_c64_tok_s(core: EngineCore) -> float:
    for _ in range(64):
        submit(core, prompt(128), 256)
    _, steps = drive(core)
    decode = [(s, n) for s, n, d in steps if d]
    return sum(n for _, n in decode) / sum(s for s, _ in decode)


def decode_figures(core: EngineCore, hbm: float, args: argparse.Namespace) -> None:
    weights = weight_bytes(core)
    kv_per_token = core.kv.layout.bytes_per_token()
    roof = weights / hbm / 1e6
    b1, b64 = replay_ms(core, 1), replay_ms(core, 64)
    default = core.async_scheduling
    runs: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    for async_on in (False, True, False, True):  # the same engine, alternating
        core.async_scheduling = async_on
        tpot, tok_s = tpot_b1_ms(core), decode_c64_tok_s(core)
        runs[async_on].append((tpot, tok_s))
        record("tpot_b1", async_scheduling=async_on, tpot_ms=tpot, roofline_ms=roof, vs_roofline=tpot / roof,
               graph_replay_ms=b1, vs_replay=tpot / b1, goal="<= 1.25x roofline and <= 1.1x replay")
        record("decode_c64", async_scheduling=async_on, tok_s=tok_s, graph_replay_b64_ms=b64,
               ideal_tok_s=64 / b64 * 1000, vs_ideal=tok_s / (64 / b64 * 1000), goal=">= 0.8")
    core.async_scheduling = default
    median = {mode: [statistics.median(r[i] for r in rs) for i in range(2)] for mode, rs in runs.items()}
    record("async_scheduling", tpot_b1_ms={"off": median[False][0], "on": median[True][0]},
           decode_c64_tok_s={"off": median[False][1], "on": median[True][1]},
           tpot_on_vs_off=median[True][0] / median[False][0], tok_s_on_vs_off=median[True][1] / median[False][1],
           default=default)

    for _ in range(64):
        submit(core, prompt(2048), 32)
    _, steps = drive(core)
    decode = [s for s, n, d in steps if d]
    step = statistics.median(decode) * 1000
    kv_bytes = 64 * 2048 * kv_per_token
    roof = (weights + kv_bytes) / hbm / 1e6
    record("long_context_b64_2048", step_ms=step, roofline_ms=roof, vs_roofline=step / roof,
           async_scheduling=default, goal="<= 1.3")


def prefill_figures(core: EngineCore, args: argparse.Namespace, first_ms: float) -> None:
    import os

    # auto (the default: cuDNN on length buckets whose plans the warm-up built) last
    for kind, length in (("cudnn", 4000), ("triton", 3900), ("flash", 3800), ("auto", 3700)):
        os.environ["PDSERVE_DENSE_PREFILL"] = kind
        new_shape = ttft_ms(core, prompt(length))  # a prompt length this process has not seen
        steady = statistics.median(ttft_ms(core, prompt(4096)) for _ in range(args.repeats))
        record(f"prefill_4096_{kind}", ttft_ms=steady, tflop_s=model_flops(args.layers, 4096) / steady / 1e9,
               new_length_ttft_ms=new_shape)
    steady = statistics.median(ttft_ms(core, prompt(4096)) for _ in range(args.repeats))
    flops = model_flops(args.layers, 4096)
    record("prefill_4096", ttft_ms=steady, tflop_s=flops / steady / 1e9, vs_peak=flops / steady / 1e9 / 989,
           goal=">= 0.6 of 989 TFLOP/s (TTFT <= 118 ms at 32 layers)")
    record("first_request_after_start", first_ttft_ms=first_ms, steady_ttft_ms=steady, ratio=first_ms / steady,
           goal="<= 1.2")


def host_tier_figures(model_dir: Path, args: argparse.Namespace, h2d: float) -> None:
    """Three cycles of: a new 4k prompt (miss), the same again (GPU hit), five other prompts that push
    its blocks out to the host pool, the same again (host hit); medians over the cycles."""
    core, _ = make_core(model_dir, args, {"max_tokens": 5 * 4096, "host_cache_size": 8 << 30})
    cycles = []
    for _ in range(3):
        a = prompt(4096)
        miss, gpu_hit = ttft_ms(core, a), ttft_ms(core, a)
        for _ in range(5):
            ttft_ms(core, prompt(4096))
        before = core.kv.stats()
        host_hit = ttft_ms(core, a)
        after = core.kv.stats()
        cycles.append((miss, gpu_hit, host_hit, after.onboards - before.onboards,
                       after.bytes_onboarded - before.bytes_onboarded))
    miss, gpu_hit, host_hit, onboarded, nbytes = (statistics.median(c[i] for c in cycles) for i in range(5))
    onboard_gb_s = nbytes / max(1e-9, (host_hit - gpu_hit) / 1000) / 1e9
    record("host_tier", miss_ttft_ms=miss, gpu_hit_ttft_ms=gpu_hit, host_hit_ttft_ms=host_hit,
           host_hit_vs_miss=host_hit / miss, onboarded_blocks=onboarded, onboard_gb_s=onboard_gb_s,
           onboard_vs_pinned=onboard_gb_s / h2d, cycles_miss_gpu_host_ms=[[round(x, 1) for x in c[:3]] for c in cycles],
           goal="host hit <= 0.3 of a miss; onboard >= 0.8 pinned")


def skinny_figures(core: EngineCore) -> None:
    """b1 TPOT with the Triton skinny GEMM where the warm-up chose it, then with cuBLAS everywhere
    (graphs captured again), in the same process: the A/B of kernels/gemv.py."""
    skinny = getattr(core.runner.model.ops, "skinny", None)
    if skinny is None or core.runner.graphs is None:
        return
    chosen = dict(skinny.chosen)

    def b1() -> float:
        rid = submit(core, prompt(128), 129)
        times, _ = drive(core)
        return (times[rid][-1] - times[rid][1]) / (len(times[rid]) - 2) * 1000

    with_skinny = statistics.median(b1() for _ in range(3))
    skinny.chosen = {key: None for key in chosen}
    core.runner.graphs.capture()
    cublas = statistics.median(b1() for _ in range(3))
    skinny.chosen = chosen
    core.runner.graphs.capture()
    record("skinny_gemv_ab", tpot_b1_ms=with_skinny, tpot_b1_cublas_ms=cublas, ratio=with_skinny / cublas,
           chosen={f"{n}x{k}": c for (n, k), c in chosen.items()})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/bench-gpu"))
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kernels", default="auto")
    parser.add_argument("--no-graphs", action="store_true")
    parser.add_argument("--max-num-tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip", default="", help="comma-separated: skinny,decode,prefill,host")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    torch.manual_seed(0)
    ceil = ceilings()
    t = time.perf_counter()
    model_dir = build_model(args.workdir / f"llama8b-shaped-{args.layers}", args.layers)
    record("model", dir=str(model_dir), build_s=time.perf_counter() - t)
    core, start_s = make_core(model_dir, args, {})
    record("startup", seconds=start_s, warm_up_s=getattr(core.runner.graphs, "capture_s", 0.0),
           kernels=core.runner.kernels)
    first = ttft_ms(core, prompt(4096))
    if "skinny" not in skip:
        skinny_figures(core)
    if "decode" not in skip:
        decode_figures(core, ceil["hbm_read_gb_s"], args)
    if "prefill" not in skip:
        prefill_figures(core, args, first)
    del core
    torch.cuda.empty_cache()
    if "host" not in skip:
        host_tier_figures(model_dir, args, ceil["pinned_h2d_gb_s"])
    print("SUMMARY " + json.dumps(RESULTS), flush=True)
    if args.out:
        args.out.write_text("".join(json.dumps(r) + "\n" for r in RESULTS))


if __name__ == "__main__":
    main()
