"""Times the paged decode attention kernel alone on the GPU (server/models/kernels/attention.py
`paged_decode`), bf16 against FP8 K/V, at each keys-per-step choice, each call replayed as a CUDA
graph. Prints one JSON line per (cache dtype, block_n): microseconds per call and the KV bytes read
over that time. Defaults: one layer of the 8B shape (32 heads, 8 kv heads of 128) at 64 sequences
of 2,080 tokens, 32-token blocks scattered over the pool.

    python scripts/bench_decode_kernel.py [--batch 64 --context 2080 --block-n 32,64,128]

Needs CUDA and Triton.
"""

from __future__ import annotations

import argparse
import json

import torch
from bench_moe_experts import time_us

from server.models.kernels.attention import decode_scratch, decode_splits, group_rows, paged_decode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=2080)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--tpb", type=int, default=32)
    parser.add_argument("--block-n", default="32,64,128")
    args = parser.parse_args()
    b, n, tpb, kvh, d = args.batch, args.context, args.tpb, args.kv_heads, args.head_dim
    nb = -(-n // tpb)
    slots = b * nb
    table = torch.randperm(slots, device="cuda", dtype=torch.int32)[: b * nb].view(b, nb)
    lens = torch.full((b,), n, dtype=torch.int32, device="cuda")
    lo = torch.zeros(b, dtype=torch.int32, device="cuda")
    q = torch.randn(b, args.heads, d, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = decode_splits(b, kvh, sms)
    scratch = decode_scratch(b, kvh, group_rows(args.heads, kvh), d, splits, q.device)
    pool = torch.randn(slots, 2, tpb, kvh, d, dtype=torch.bfloat16, device="cuda")
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        kv = pool.to(dtype)
        k, v = kv[:, 0], kv[:, 1]
        kv_bytes = 2 * b * n * kvh * d * kv.element_size()
        for block_n in (int(x) for x in args.block_n.split(",")):
            us = time_us(lambda k=k, v=v, block_n=block_n: paged_decode(
                q, k, v, table, lens, lo, out, d**-0.5, splits, scratch, block_n=block_n))
            print(json.dumps({"cache": str(dtype).removeprefix("torch."), "block_n": block_n, "splits": splits,
                              "us": round(us, 1), "kv_gb_s": round(kv_bytes / us / 1e3, 1)}), flush=True)


if __name__ == "__main__":
    main()
