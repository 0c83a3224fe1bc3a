"""Times the routed experts of one MoE layer on the GPU: the fused Triton grouped GEMMs
(server/models/kernels/moe.py) against the dense torch path (every expert on every token), bf16,
random weights, uniform random routing, each call replayed as a CUDA graph. Prints one JSON line
per (path, tokens): microseconds per call and the bytes of the experts the step touches divided by
that time (the roofline's numerator). For steps of at most 64 pairs also every warm-up candidate
tile of the step's pair class, grouped and per-pair (kernels/moe.py PER_PAIR_TILES), one line each,
then a "compare" line: the fastest of each kind, their ratio, and the per-pair kernels' error
against the float32 torch experts.

    python scripts/bench_moe_experts.py [--experts 128 --top-k 8 --hidden 2048 --inter 768]

Defaults are a Qwen3-30B-A3B layer. Needs CUDA and Triton.
"""

from __future__ import annotations

import argparse
import functools
import json

import torch

from server.models.kernels.moe import CANDIDATES, PER_PAIR_TILES, fused_experts, pair_class
from server.models.moe.experts import dense_experts


def time_us(fn, repeats: int = 20) -> float:
    """Microseconds per call of `fn` replayed as a CUDA graph (as serving's decode steps run it)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / repeats


def _compare_tiles(x, gate_up, down, weights, ids, touched: int) -> None:
    """Every candidate tile of this step's pair class, grouped and per-pair: one line each, then the
    fastest of each kind side by side."""
    t = x.shape[0]
    cls = pair_class(ids.numel())
    timed = {}
    for tile in dict.fromkeys((*CANDIDATES[cls], *PER_PAIR_TILES)):
        timed[tile] = time_us(functools.partial(fused_experts, x, gate_up, down, weights, ids, tile))
        print(json.dumps({"tile": tile, "kind": "per-pair" if tile[0] == 1 else "grouped", "tokens": t,
                          "us": round(timed[tile], 1), "touched_GBps": round(touched / timed[tile] / 1e3, 1)}))
    grouped = min((tile for tile in timed if tile[0] > 1), key=timed.get)
    per_pair = min(PER_PAIR_TILES, key=timed.get)
    ref = dense_experts(x.float(), gate_up.float(), down.float(), weights, ids)
    got = fused_experts(x, gate_up, down, weights, ids, per_pair).float()
    print(json.dumps({"compare": "fastest grouped vs fastest per-pair tile", "tokens": t,
                      "grouped_tile": grouped, "grouped_us": round(timed[grouped], 1),
                      "per_pair_tile": per_pair, "per_pair_us": round(timed[per_pair], 1),
                      "grouped_over_per_pair": round(timed[grouped] / timed[per_pair], 2),
                      "per_pair_touched_GBps": round(touched / timed[per_pair] / 1e3, 1),
                      "per_pair_rel_err": round(((got - ref).norm() / ref.norm()).item(), 5)}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=768)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 64, 256, 2048])
    parser.add_argument("--dense-max", type=int, default=64, help="largest token count the dense path runs")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    e, h, i = args.experts, args.hidden, args.inter
    gate_up = torch.randn(e, 2 * i, h, device="cuda", generator=gen, dtype=torch.bfloat16) * h ** -0.5
    down = torch.randn(e, h, i, device="cuda", generator=gen, dtype=torch.bfloat16) * i ** -0.5
    expert_bytes = (gate_up[0].numel() + down[0].numel()) * 2
    for t in args.tokens:
        x = torch.randn(t, h, device="cuda", generator=gen, dtype=torch.bfloat16)
        ids = torch.rand(t, e, device="cuda", generator=gen).topk(args.top_k, dim=-1).indices
        weights = torch.rand(t, args.top_k, device="cuda", generator=gen)
        touched = int(torch.unique(ids).numel()) * expert_bytes
        paths = {"fused": fused_experts} | ({"dense": dense_experts} if t <= args.dense_max else {})
        for name, fn in paths.items():
            us = time_us(functools.partial(fn, x, gate_up, down, weights, ids))
            print(json.dumps({"path": name, "tokens": t, "us": round(us, 1), "experts_touched": touched // expert_bytes,
                              "touched_GBps": round(touched / us / 1e3, 1)}))
        if t * args.top_k <= 64:
            _compare_tiles(x, gate_up, down, weights, ids, touched)
        ref = dense_experts(x[:8], gate_up, down, weights[:8], ids[:8]).float()
        got = fused_experts(x[:8], gate_up, down, weights[:8], ids[:8]).float()
        print(json.dumps({"check": "fused vs dense, bf16, 8 tokens", "rel_err": round(
            ((got - ref).norm() / ref.norm()).item(), 5)}))


if __name__ == "__main__":
    main()
