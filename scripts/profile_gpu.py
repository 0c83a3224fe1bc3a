"""Where a decode step's GPU time goes, on the 8B-shaped model of bench_gpu.py (device machine only).

For each (batch, context) case the decode graph's static plan is filled with `batch` sequences of
`context` tokens on distinct pool slots, then:
- the graph replay is timed (CUDA events, median of 50);
- one eager forward of the same plan runs under torch.profiler: GPU time per kernel name per forward,
  grouped into GEMMs, attention, elementwise and the rest;
- every linear layer's GEMM is timed alone at that batch against its weight bytes / HBM bandwidth;
- the Triton decode attention kernel is swept over tile sizes, warps, stages and splits, timed on
  the real pool views, against its KV bytes / HBM bandwidth.

    python scripts/profile_gpu.py --workdir /tmp/bench-gpu [--cases 1x384,64x384,64x2048]
    python scripts/profile_gpu.py --model-dir /tmp/bench-moe/qwen3moe-16 --parts replay,kernels --cases 1x128,64x128
      (another model directory, e.g. a MoE shape scripts/bench_gpu_moe.py built: its replay and kernel
      breakdown; the GEMM and attention sweeps read the dense model's linears and K/V pool)

Prints one JSON line per finding.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch
from bench_gpu import ceilings, make_core, timed_ms

from pdserve_bench.gpu_handoff import build_model
from server.models.attention import SeqLayout
from server.models.kernels import attention as attn


def emit(name: str, **row: object) -> None:
    print(json.dumps({"profile": name, **row}), flush=True)


def fill(core, batch: int, context: int) -> None:
    graphs = core.runner.graphs
    backend = graphs.attention
    pool = backend.latents[0] if hasattr(backend, "latents") else backend.views[0][0]  # MLA: one latent pool
    tpb, slots = backend.tpb, pool.shape[0]
    per_seq = -(-context // tpb)
    seqs = [SeqLayout(context - 1, 1, {w: [(r * per_seq + j) % slots for j in range(per_seq)]
                                       for w in backend.kv.window_sizes}) for r in range(batch)]
    graphs.plans[batch].fill(seqs, [100 + r for r in range(batch)])
    torch.cuda.synchronize()


def kind_of(name: str) -> str:
    low = name.lower()
    if any(k in low for k in ("gemm", "gemv", "cutlass", "sm90", "xmma", "cublas", "nvjet")):
        return "gemm"
    if "decode" in low or "prefill" in low or "flash" in low:
        return "attention"
    if any(k in low for k in ("rms", "rope", "silu", "elementwise", "vectorized", "reduce")):
        return "elementwise"
    return "other"


def kernel_breakdown(core, batch: int, runs: int = 5) -> dict:
    graphs = core.runner.graphs
    plan = graphs.plans[batch]
    rows = plan.logit_rows
    model = graphs.model
    with torch.no_grad():
        for _ in range(2):
            model.forward(plan.token_ids, plan.positions, plan.meta, rows)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(runs):
                model.forward(plan.token_ids, plan.positions, plan.meta, rows)
            torch.cuda.synchronize()
    per_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per_name[ev.name][0] += ev.device_time_total / runs
            per_name[ev.name][1] += 1 / runs
    kinds: dict[str, float] = defaultdict(float)
    for name, (us, _) in per_name.items():
        kinds[kind_of(name)] += us
    top = sorted(per_name.items(), key=lambda kv: -kv[1][0])[:24]
    return {"kernels_per_forward": round(sum(c for _, c in per_name.values())),
            "gpu_us_per_forward": round(sum(us for us, _ in per_name.values()), 1),
            "by_kind_us": {k: round(v, 1) for k, v in kinds.items()},
            "top": [[n[:90], round(us, 1), round(c, 1)] for n, (us, c) in top]}


def gemm_efficiency(core, batch: int, hbm: float) -> list:
    layer = core.runner.model.layers[0]
    out = []
    for name, w in sorted(vars(layer).items()):
        if isinstance(w, torch.Tensor) and w.dim() == 2 and w.numel() > 1 << 20:
            x = torch.randn(batch, w.shape[1], dtype=w.dtype, device=w.device)
            ms = timed_ms(lambda x=x, w=w: torch.nn.functional.linear(x, w), repeats=50)
            floor = w.numel() * w.element_size() / hbm / 1e6
            out.append([name, list(w.shape), round(ms * 1000, 1), round(floor / ms, 3)])
    return out


def attention_sweep(core, batch: int, context: int, hbm: float) -> list:
    backend = core.runner.graphs.attention
    k, v = backend.views[0]
    plan = core.runner.graphs.plans[batch]
    meta = plan.meta[backend.kv.window_sizes[0]].decode
    heads, d = backend.num_heads, backend.head_dim
    q = torch.randn(batch, heads, d, dtype=k.dtype, device=k.device)
    out = torch.empty_like(q)
    kv_bytes = 2 * batch * context * k.shape[2] * d * k.element_size()
    rows = []
    base_splits = attn.decode_splits(batch, k.shape[2], backend.num_sms)
    for block_n in (32, 64, 128):
        for warps in (4, 8):
            for stages in (2, 3):
                for mult in (1, 2, 4):
                    splits = min(64, base_splits * mult)
                    ms = _time_decode(q, k, v, meta, out, backend, splits, block_n, warps, stages)
                    if ms is not None:
                        rows.append([block_n, warps, stages, splits, round(ms * 1000, 1),
                                     round(kv_bytes / hbm / 1e6 / ms, 3)])
    rows.sort(key=lambda r: r[4])
    return rows[:8] + [r for r in rows if r[:3] == [64, 4, 2] and r[3] == base_splits]


def _time_decode(q, k, v, meta, out, backend, splits, block_n, warps, stages) -> float | None:
    b, heads, d = q.shape
    kvh = k.shape[2]
    g = heads // kvh
    gp = attn.group_rows(heads, kvh)
    part, m, lsum = attn.decode_scratch(b, kvh, gp, d, splits, q.device)
    ks, kt, kh = k.stride(0), k.stride(1), k.stride(2)

    def run() -> None:
        attn._decode_split[(b, kvh, splits)](
            q, k, v, meta.block_table, meta.seq_lens, meta.lo, part, m, lsum,
            q.stride(0), q.stride(1), ks, kt, kh, meta.block_table.stride(0), backend.scale * attn.LOG2E,
            KVH=kvh, G=g, GP=gp, D=d, TPB=k.shape[1], NSPLIT=splits, BLOCK_N=block_n, IEEE=False,
            FP16_DOT=attn.fp16_dot(q, k), num_warps=warps, num_stages=stages)
        attn._decode_merge[(b, heads)](part, m, lsum, out, out.stride(0), out.stride(1), KVH=kvh, G=g, GP=gp,
                                       D=d, NSPLIT=splits, SP=max(2, 1 << (splits - 1).bit_length()), num_warps=4)
    try:
        return timed_ms(run, repeats=30)
    except Exception as exc:  # noqa: BLE001 - a config the compiler refuses is skipped and named
        emit("sweep_refused", config=[block_n, warps, stages, splits], error=str(exc)[:120])
        return None


def host_hit_profile(core) -> None:
    """A 4k prompt pushed out to the host pool, then hit again under torch.profiler: wall time, and
    GPU time and count per kernel / memcpy kind (what an onboard costs and where it waits)."""
    from bench_gpu import prompt, ttft_ms

    a = prompt(4096)
    ttft_ms(core, a)
    gpu_hit = ttft_ms(core, a)
    for _ in range(5):
        ttft_ms(core, prompt(4096))
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        host_hit = ttft_ms(core, a)
    per_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    cpu: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        table = per_name if ev.device_type == torch.autograd.DeviceType.CUDA else cpu
        key = ev.name[:70]
        table[key][0] += (ev.device_time_total if table is per_name else ev.cpu_time_total) / 1000
        table[key][1] += 1
    top = lambda t: [[n, round(ms, 2), c] for n, (ms, c) in sorted(t.items(), key=lambda kv: -kv[1][0])[:12]]  # noqa: E731
    emit("host_hit", gpu_hit_ms=gpu_hit, host_hit_ms=host_hit, gpu_top_ms=top(per_name), cpu_top_ms=top(cpu))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/bench-gpu"))
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--cases", default="1x384,64x384,64x2048")
    parser.add_argument("--kernels", default="auto")
    parser.add_argument("--no-graphs", action="store_true")
    parser.add_argument("--max-num-tokens", type=int, default=8192)
    parser.add_argument("--host-tier", action="store_true", help="profile a host-tier hit instead")
    parser.add_argument("--model-dir", type=Path, help="profile this model directory instead of the 8B shape")
    parser.add_argument("--parts", default="replay,kernels,gemm,attention")
    args = parser.parse_args()
    if args.host_tier:
        model_dir = build_model(args.workdir / f"llama8b-shaped-{args.layers}", args.layers)
        core, _ = make_core(model_dir, args, {"max_tokens": 5 * 4096, "host_cache_size": 8 << 30})
        for _ in range(2):
            host_hit_profile(core)
        return
    hbm = ceilings()["hbm_read_gb_s"]
    model_dir = args.model_dir or build_model(args.workdir / f"llama8b-shaped-{args.layers}", args.layers)
    core, _ = make_core(model_dir, args, {})
    parts = set(args.parts.split(","))
    for case in args.cases.split(","):
        batch, context = map(int, case.split("x"))
        fill(core, batch, context)
        if "replay" in parts:
            emit("replay", batch=batch, context=context, ms=timed_ms(core.runner.graphs.graphs[batch].replay, 50))
        if "kernels" in parts:
            emit("kernels", batch=batch, context=context, **kernel_breakdown(core, batch))
        if "gemm" in parts:
            emit("gemm", batch=batch, rows=gemm_efficiency(core, batch, hbm))
        if "attention" in parts:
            emit("attention_sweep", batch=batch, context=context,
                 rows_block_n_warps_stages_splits_us_vs_roof=attention_sweep(core, batch, context, hbm))


if __name__ == "__main__":
    main()
