"""KV handoff on one GPU: context and generation servers of an 8B-shaped model, a 4,096-token prompt.

Builds a random-weight model with Llama-3.1-8B dimensions (bfloat16, written once as safetensors),
starts a context and a generation server on the same GPU, and for several fresh 4,096-token prompts
times the context leg (prefill + first token) and the KV handoff the generation server reports
(`pdserve_kv_transfer_seconds`, `pdserve_kv_transfer_bytes_total`). The baseline, measured in the
same run, is the pinned host<->device copy bandwidth of the same machine (the transfer is staged
through host memory: device gather -> pinned staging -> ZeroMQ -> pinned staging -> device scatter).

    pdserve-bench gpu-handoff --workdir /tmp/handoff [--layers 32] [--repeat 3]

`--repeat` is the number of timed prompts (after one warm-up). One record: medians (handoff and
context leg) and the best handoff rate; each prompt a repeat. `build_model` is importable
(`from pdserve_bench.gpu_handoff import build_model`) for other GPU benchmarks.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch

from pdserve_bench import options
from pdserve_bench.record import REPO

HELP = "KV handoff on one GPU between a context and a generation server (8B-shaped model)"

LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                head_dim=128, vocab_size=128256, rms_norm_eps=1e-5, max_position_embeddings=8192,
                rope_theta=500000.0)


def build_model(out: Path, layers: int, text_tokens: int | None = None, cycle: int | None = None,
                shape: dict | None = None) -> Path:
    """Random bfloat16 weights with 8B shapes (written shard by shard from the GPU).

    With `text_tokens` (e.g. 512, the tiny tokenizer's size), the lm_head rows of every id at or
    above it and of the tokenizer's special ids are zero, so greedy decoding always picks a token
    that decodes to text and a streamed answer carries text for every token (SSE sends text only).
    Without it, argmax lands anywhere in the 128,256 ids (most decode to nothing): as before.

    With `cycle` (needs `text_tokens`), the weights keep their shapes and cost but make greedy
    decoding walk fixed cycles of `cycle` text ids (`cycle_successors`): the attention and MLP
    outputs are scaled down so the residual stream stays the current token's embedding, and the
    lm_head row of id j is the sum of the embeddings of the ids whose successor is j. A random-weight
    model never repeats its prompt; this one does, so a prompt that walks a cycle has an answer that
    copies it (the copy-heavy workload of speculative decoding). `shape` overrides LLAMA_8B's sizes."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, LlamaConfig

    from server.models.builtin import resolve_model

    if (out / "config.json").exists():
        return out
    dims = {**LLAMA_8B, **(shape or {})}
    out.mkdir(parents=True, exist_ok=True)
    tiny = resolve_model("builtin:tiny-llama")
    for f in tiny.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, out / f.name)
    LlamaConfig(architectures=["LlamaForCausalLM"], num_hidden_layers=layers, bos_token_id=1, eos_token_id=2,
                pad_token_id=0, tie_word_embeddings=False, torch_dtype="bfloat16", **dims).save_pretrained(out)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(0)
    h, i, v = dims["hidden_size"], dims["intermediate_size"], dims["vocab_size"]
    kvd = dims["num_key_value_heads"] * dims["head_dim"]
    qd = dims["num_attention_heads"] * dims["head_dim"]
    out_scale = 1e-4 if cycle else 1.0  # o_proj and down_proj: the layers barely move the residual stream

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device, dtype=torch.bfloat16) * (0.02 * scale)).cpu()

    embed = rnd(v, h)
    lm_head = _cycle_head(embed, text_tokens, cycle) if cycle else rnd(v, h)
    if text_tokens is not None:
        lm_head[text_tokens:] = 0  # logit 0 never wins against ~500 random logits of either sign
        lm_head[AutoTokenizer.from_pretrained(out).all_special_ids] = 0
    save_file({"model.embed_tokens.weight": embed, "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
               "lm_head.weight": lm_head}, out / "model-00000.safetensors")
    for layer in range(layers):
        p = f"model.layers.{layer}."
        save_file({p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                   p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                   p + "self_attn.q_proj.weight": rnd(qd, h), p + "self_attn.k_proj.weight": rnd(kvd, h),
                   p + "self_attn.v_proj.weight": rnd(kvd, h),
                   p + "self_attn.o_proj.weight": rnd(h, qd, scale=out_scale),
                   p + "mlp.gate_proj.weight": rnd(i, h), p + "mlp.up_proj.weight": rnd(i, h),
                   p + "mlp.down_proj.weight": rnd(h, i, scale=out_scale)}, out / f"model-{layer + 1:05d}.safetensors")
    return out


CYCLE_FIRST = 10  # the cycles start at id 10, as the benchmarks' prompt ids do


def cycle_successors(text_tokens: int, cycle: int) -> dict[int, int]:
    """The successor of every text id under `build_model(..., cycle=...)`: ids CYCLE_FIRST.. form
    consecutive cycles of `cycle` ids (a, a+1, ..., a+cycle-1, a); every other id leads into the first."""
    whole = (text_tokens - CYCLE_FIRST) // cycle * cycle
    succ = {t: CYCLE_FIRST for t in range(text_tokens)}
    for t in range(CYCLE_FIRST, CYCLE_FIRST + whole):
        start = t - (t - CYCLE_FIRST) % cycle
        succ[t] = start + (t - start + 1) % cycle
    return succ


def _cycle_head(embed: torch.Tensor, text_tokens: int | None, cycle: int) -> torch.Tensor:
    if text_tokens is None:
        raise ValueError("build_model(cycle=...) needs text_tokens")
    head = torch.zeros_like(embed, dtype=torch.float32)
    for t, nxt in cycle_successors(text_tokens, cycle).items():
        head[nxt] += embed[t].float()
    return head.to(torch.bfloat16)


def pinned_bandwidth(nbytes: int = 512 << 20, repeats: int = 5) -> dict[str, float]:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = {}
    for name, (dst, src) in {"h2d": (dev, host), "d2h": (host, dev)}.items():
        best = float("inf")
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            torch.cuda.synchronize()
            best = min(best, start.elapsed_time(end) / 1000)
        out[name] = nbytes / best / 1e9
    return out


TOKEN = "bench-handoff-token-0123456789"
AUTHORISED = {"x-pdserve-token": TOKEN}  # what the router sends (docs/SECURITY.md)
CONTEXT_URL = "127.0.0.1:18801"


def start_server(workdir: Path, model: Path, role: str, port: int) -> subprocess.Popen:
    cfg = workdir / f"{role}.yaml"
    peers = {"context_urls": [CONTEXT_URL]} if role == "generation" else {}
    cfg.write_text(json.dumps({**peers, "model": str(model), "hostname": "127.0.0.1", "port": port,
                               "max_seq_len": 8192, "max_num_tokens": 8192, "max_batch_size": 8,
                               "kv_cache_config": {"max_tokens": 16384, "tokens_per_block": 32},
                               "cache_transceiver_config": {"kv_transfer_timeout_ms": 120000}}))
    env = {**os.environ, "PDSERVE_AUTH_TOKEN": TOKEN, "HF_HUB_OFFLINE": "1"}
    log = open(workdir / f"{role}.log", "w")
    return subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--config", str(cfg), "--role", role],
                            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 600) -> None:
    from pdserve_bench.launch import wait_for_health

    if wait_for_health(url, timeout_s, lambda: proc.poll() is None, interval_s=1.0):
        return
    if proc.poll() is not None:
        log = Path(proc.args[-3]).with_suffix(".log")  # <workdir>/<role>.log beside <role>.yaml
        raise SystemExit(f"server {url} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
    raise SystemExit(f"{url} not healthy in time")


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def one_handoff(ctx: str, gen: str, prompt: list[int]) -> dict[str, float]:
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    t0 = time.perf_counter()
    answer = httpx.post(f"{ctx}/v1/completions", timeout=600, headers=AUTHORISED,
                        json={**body, "disaggregated_params": {"request_type": "context_only"}}).json()
    t1 = time.perf_counter()
    params = answer["choices"][0]["disaggregated_params"]
    secs0, bytes0 = metric(gen, "pdserve_kv_transfer_seconds_sum"), metric(gen, "pdserve_kv_transfer_bytes_total")
    done = httpx.post(f"{gen}/v1/completions", timeout=600, headers=AUTHORISED,
                      json={**body, "disaggregated_params": {**params, "request_type": "generation_only"}})
    t2 = time.perf_counter()
    assert done.status_code == 200, done.text
    time.sleep(0.3)  # metrics snapshots are refreshed every 0.1 s
    secs = metric(gen, "pdserve_kv_transfer_seconds_sum") - secs0
    nbytes = metric(gen, "pdserve_kv_transfer_bytes_total") - bytes0
    return {"context_leg_s": t1 - t0, "generation_leg_s": t2 - t1, "handoff_s": secs, "bytes": nbytes,
            "handoff_gb_s": nbytes / secs / 1e9 if secs else 0.0}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/pdserve-handoff"))
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=4096)
    options.add_common(parser, repeat=3, model=False)


def run(args: argparse.Namespace) -> int:
    out = options.writer(args)
    args.workdir.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    model = build_model(args.workdir / "llama8b-shaped", args.layers)
    print(f"model ready in {time.perf_counter() - t:.1f} s: {model}", flush=True)
    bandwidth = pinned_bandwidth()
    print(f"pinned copy GB/s: {bandwidth}", flush=True)
    roles = (("context", 18801), ("generation", 18802))
    servers = [start_server(args.workdir, model, role, port) for role, port in roles]
    ctx, gen = "http://127.0.0.1:18801", "http://127.0.0.1:18802"
    try:
        for url, proc in zip((ctx, gen), servers, strict=True):
            wait_healthy(url, proc)
        rng = torch.Generator().manual_seed(1)
        results = []
        for k in range(args.repeat + 1):  # the first is a warm-up (connection set-up, allocator)
            prompt = torch.randint(10, 500, (args.prompt_len,), generator=rng).tolist()  # the tokenizer is the tiny one
            r = one_handoff(ctx, gen, prompt)
            print(("warm-up " if k == 0 else "") + json.dumps(r), flush=True)
            if k:
                results.append(r)
        best = max(results, key=lambda r: r["handoff_gb_s"])
        med = sorted(r["handoff_s"] for r in results)[len(results) // 2]
        summary = {"prompt_tokens": args.prompt_len, "layers": args.layers, "kv_bytes": best["bytes"],
                   "handoff_s_median": med, "handoff_gb_s_best": best["handoff_gb_s"],
                   "context_leg_s_median": sorted(r["context_leg_s"] for r in results)[len(results) // 2],
                   "pinned_h2d_gb_s": bandwidth["h2d"], "pinned_d2h_gb_s": bandwidth["d2h"],
                   "handoff_vs_pinned_h2d": best["handoff_gb_s"] / bandwidth["h2d"]}
        print("SUMMARY " + json.dumps(summary), flush=True)
    finally:
        for proc in servers:
            proc.terminate()
        for proc in servers:
            proc.wait(timeout=30)
    config = {"model": "Llama-3.1-8B-shaped, random bf16", "layers": args.layers, "prompt_tokens": args.prompt_len,
              "repeat": args.repeat}
    out.write("gpu-handoff", config, {k: float(v) for k, v in summary.items()}, results)
    return 0
