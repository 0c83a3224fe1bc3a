"""Speculative decoding figure, engine level: batch-1 TPOT with and without
n-gram speculation on the 8B-shaped random-weight model (`pdserve_bench.gpu_handoff.build_model`),
the engine built as `pdserve serve` builds it (async scheduling and decode CUDA graphs on CUDA;
verify steps replay the decode graphs, each verify token a decode row: runner.as_decode_rows).

Workloads (one request at a time, INPUT tokens in, OUTPUT out, ignore_eos):
- copy: greedy on a model of the same shapes and cost whose answers walk fixed 64-token cycles
  (`build_model(..., cycle=64)`; a random-weight model never repeats its prompt, so it cannot give
  this workload), each prompt INPUT tokens of a cycle from a random start: the answer copies the
  prompt, as in code editing or RAG answers that quote it (acceptance near 1: the upper bound);
- random: random prompts, greedy;
- sampled: random prompts, temperature 1.0 with a seed per request (near-uniform: drafts almost
  never land; the adaptive pause must keep it within 5% of no speculation).
Each figure: median b1 TPOT off / on, the speed-up, acceptance rate, tokens per verify step, and
whether the outputs were identical (greedy, and seeded sampling: they must be).
Goal: copy >= 1.8x faster; random and sampled never more than 5% slower.

    python scripts/bench_gpu_spec.py --workdir /tmp/bench-gpu [--layers 32] [--k 4]
    python scripts/bench_gpu_spec.py --model builtin:tiny-llama --output-len 64   # a CPU smoke run
    python scripts/bench_gpu_spec.py --small --workloads copy --output-len 64   # the copy model, small

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

from pdserve_bench.gpu_handoff import CYCLE_FIRST, build_model
from server.config.schema import server_config_from_dict
from server.engine.core import EngineCore
from server.engine.speculative.config import SpeculativeConfig
from server.engine.speculative.decoder import NoSpeculation, SpecDecoder
from server.engine.speculative.ngram import NgramDrafter
from server.engine_host.build import build_core
from server.telemetry.metrics import ServerMetrics
from server.types import GenerateRequest, SamplingParams

TEXT_TOKENS = 512  # the tiny tokenizer's size: prompt ids are drawn from [10, 500)
CYCLE = 64  # the copy model's cycle length
SMALL = dict(hidden_size=1024, intermediate_size=2048, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
             vocab_size=TEXT_TOKENS)  # --small: a CPU-sized model with the same construction
RESULTS: list[dict] = []


def make_core(model: str, args: argparse.Namespace) -> EngineCore:
    cfg = server_config_from_dict({
        "model": model, "max_seq_len": 4096, "max_num_tokens": 2048, "max_batch_size": 16,
        "kv_cache_config": {"tokens_per_block": 32, "max_tokens": 65536},
        "cache_transceiver_config": {"auth_token": "bench-gpu-spec-token-0123456789"}}, "bench_gpu_spec")
    return build_core(cfg, ServerMetrics())


def prompts(workload: str, n: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    if workload != "copy":
        return [torch.randint(10, 500, (length,), generator=gen).tolist() for _ in range(n)]
    cycles = (TEXT_TOKENS - CYCLE_FIRST) // CYCLE
    out = []
    for _ in range(n):  # the copy model's successor of id t in cycle c is the next id of c, wrapping
        start = CYCLE_FIRST + CYCLE * int(torch.randint(cycles, (1,), generator=gen))
        first = int(torch.randint(CYCLE, (1,), generator=gen))
        out.append([start + (first + j) % CYCLE for j in range(length)])
    return out


def run_one(core: EngineCore, prompt: list[int], params: SamplingParams) -> tuple[list[int], float]:
    """(tokens, b1 TPOT in ms: the mean time between the first and the last token)."""
    rid = uuid.uuid4().hex
    core.add_request(GenerateRequest(rid, prompt, params))
    tokens, times = [], []
    while core.has_work():
        outputs = core.step()
        now = time.perf_counter()
        for out in outputs:
            tokens += out.new_token_ids
            times += [now] * len(out.new_token_ids)
    return tokens, (times[-1] - times[0]) / (len(times) - 1) * 1000


def figure(core: EngineCore, spec: SpecDecoder, workload: str, args: argparse.Namespace) -> None:
    sampled = workload == "sampled"
    cases = prompts(workload, args.requests, args.input_len, seed=len(workload))
    params = [SamplingParams(max_tokens=args.output_len, temperature=1.0 if sampled else 0.0, ignore_eos=True,
                             seed=i if sampled else None) for i in range(len(cases))]
    run_one(core, cases[0], params[0])  # warm: this prompt length's prefill and the eager verify shapes
    core.spec = NoSpeculation()
    off = [run_one(core, p, s) for p, s in zip(cases, params, strict=True)]
    core.spec = spec
    before = (spec.stats.proposed, spec.stats.accepted, spec.stats.emitted, spec.stats.verified)
    on = [run_one(core, p, s) for p, s in zip(cases, params, strict=True)]
    proposed, accepted, emitted, verified = (now - then for now, then in zip(
        (spec.stats.proposed, spec.stats.accepted, spec.stats.emitted, spec.stats.verified), before, strict=True))
    off_ms, on_ms = statistics.median(t for _, t in off), statistics.median(t for _, t in on)
    record("spec_b1_tpot", workload=workload, k=args.k, input_len=args.input_len, output_len=args.output_len,
           tpot_off_ms=round(off_ms, 3), tpot_on_ms=round(on_ms, 3), speedup=round(off_ms / on_ms, 3),
           acceptance_rate=round(accepted / proposed, 3) if proposed else None,
           tokens_per_verify_step=round(emitted / verified, 3) if verified else None,
           verify_share=round(emitted / (args.output_len * len(cases)), 3),
           identical=[a for a, _ in off] == [b for b, _ in on])


def record(name: str, **figures: object) -> None:
    row = {"figure": name, **figures}
    RESULTS.append(row)
    print(json.dumps(row), flush=True)


def model_for(args: argparse.Namespace, copy: bool) -> str:
    """--model as given; else the 8B-shaped text model, or its copy twin (cycles) for the copy workload."""
    if args.model:
        return args.model
    shape, size = (SMALL, "small") if args.small else (None, "8b")
    name = f"llama{size}-{'cycle' + str(CYCLE) if copy else 'text'}-{args.layers}"
    return str(build_model(args.workdir / name, args.layers, text_tokens=TEXT_TOKENS, cycle=CYCLE if copy else None,
                           shape=shape))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/bench-gpu"))
    parser.add_argument("--model", help="a model instead of the 8B-shaped one (e.g. builtin:tiny-llama)")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--small", action="store_true", help="CPU-sized models of the same construction")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--workloads", default="copy,random,sampled")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    workloads = args.workloads.split(",")
    for copy in (True, False):
        names = [w for w in workloads if (w == "copy") == copy]
        if not names:
            continue
        core = make_core(model_for(args, copy), args)
        config = SpeculativeConfig(method="ngram", num_speculative_tokens=args.k)
        spec = SpecDecoder(config, core.config, NgramDrafter(config.ngram_min, config.ngram_max))
        for workload in names:
            figure(core, spec, workload, args)
        del core, spec
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print("SUMMARY " + json.dumps(RESULTS))
    if args.out:
        args.out.write_text("".join(json.dumps(r) + "\n" for r in RESULTS))


if __name__ == "__main__":
    main()
