"""Diagnostic (GPU): where a pair's time to first token goes, one request at a time, and whether the
pair's greedy texts depend on `gpu_share` or the dtype.

For each variant (aggregated, pair with gpu_share off/auto, float32 or bf16, engine process on/off) it
launches the deployment (tests/deploy_harness.py), sends --requests streamed requests one at a time
(prompt of --prompt-words words, --max-tokens tokens, usage chunk on), prints the client's TTFT p50 and
every non-empty `*_seconds` histogram mean of the router and the servers, then the greedy texts of the
gpu_share test's prompts.

    python3 scripts/diag_pair_first_event.py [--model builtin:tiny-llama] [--variants agg,off,auto,...]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]
import deploy_harness  # noqa: E402

PROMPTS = ["The quick brown fox", "abc " * 200]
VARIANTS = {
    "agg": ("aggregated.yaml", {}),
    "off": ("disagg.yaml", {"gpu_share": "off"}),
    "auto": ("disagg.yaml", {"gpu_share": "auto"}),
    "off_f32": ("disagg.yaml", {"gpu_share": "off", "dtype": "float32"}),
    "auto_f32": ("disagg.yaml", {"gpu_share": "auto", "dtype": "float32"}),
    "off_thread": ("disagg.yaml", {"gpu_share": "off", "engine_process": False}),
    "off_nographs": ("disagg.yaml", {"gpu_share": "off", "cuda_graphs": False}),
    "off_process": ("disagg.yaml", {"gpu_share": "off", "engine_process": True}),
    "mps100": ("disagg.yaml", {"gpu_share": 100}),  # both servers under MPS, no SM limit
    "auto_nographs": ("disagg.yaml", {"gpu_share": "auto", "cuda_graphs": False}),
    "auto_torch": ("disagg.yaml", {"gpu_share": "auto", "kernels": "torch"}),  # no Triton kernels
    "share60": ("disagg.yaml", {"gpu_share": 60}),  # both servers limited to 60% of the SMs
}


def one_request(url: str, prompt: str | list[int], max_tokens: int) -> tuple[float, float, int]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    start, first, tokens = time.perf_counter(), None, 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if first is None and (chunk.get("choices") or [{}])[0].get("text"):  # as the benchmarks count
                first = time.perf_counter() - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return first or float("nan"), time.perf_counter() - start, tokens


def event_trace(url: str, prompt: str | list[int], max_tokens: int, first: int = 8) -> list[str]:
    """The first `first` SSE events of one streamed request: ms since sending, then the text and usage."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    start, trace = time.perf_counter(), []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data:") and len(trace) < first:
                data = line[5:].strip()
                brief = data if data == "[DONE]" else json.dumps(
                    [(c.get("text"), c.get("finish_reason")) for c in json.loads(data).get("choices") or []])
                trace.append(f"{1000 * (time.perf_counter() - start):.1f} ms {brief}")
    return trace


def first_logprobs(url: str, prompt: str, tokens: int = 4) -> list:
    """The top-3 logprobs of a short greedy completion's first tokens (NaN or -inf show a broken forward)."""
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "logprobs": 3}
    choice = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"][0]
    return (choice.get("logprobs") or {}).get("top_logprobs") or []


def histogram_means(url: str) -> dict[str, float]:
    """name{labels} -> mean in ms of every `*_seconds` histogram with samples."""
    sums, counts = {}, {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("#") or "_seconds_" not in line:
            continue
        key, value = line.rsplit(" ", 1)
        if "_seconds_sum" in key:
            sums[key.replace("_sum", "")] = float(value)
        elif "_seconds_count" in key:
            counts[key.replace("_count", "")] = float(value)
    return {k: 1000 * sums[k] / c for k, c in counts.items() if c and k in sums}


def make_prompts(args: argparse.Namespace, n: int) -> list[str] | list[list[int]]:
    """`n` distinct prompts: words, or (--token-prompts, as the load benchmarks send) random token ids."""
    if not args.token_prompts:
        words = " ".join(f"word{i % 97}" for i in range(args.prompt_words))
        return [f"{i} {words}" for i in range(n)]
    from transformers import AutoTokenizer

    from pdserve_bench.workloads import usable_token_ids
    vocab = usable_token_ids(AutoTokenizer.from_pretrained(args.model))
    rng = random.Random(0)
    return [[vocab[rng.randrange(len(vocab))] for _ in range(args.prompt_words)] for _ in range(n)]


def run_variant(name: str, args: argparse.Namespace, tmp: Path) -> dict:
    config, overrides = VARIANTS[name]
    overrides = {"dtype": args.dtype, **overrides, "model": args.model, "max_seq_len": 2048}
    if args.kv_max_tokens:  # two servers of a large model on one GPU: a bounded pool each
        overrides["kv_cache_config"] = {"max_tokens": args.kv_max_tokens}
    (tmp / name).mkdir()
    with deploy_harness.launched(config, tmp / name, overrides) as dep:
        prompts = make_prompts(args, args.requests + 4)
        for prompt in prompts[:3]:
            one_request(dep.url, prompt, args.max_tokens)
        trace = event_trace(dep.url, prompts[3], args.max_tokens)
        runs = [one_request(dep.url, prompt, args.max_tokens) for prompt in prompts[4:]]
        ttft = statistics.median(r[0] for r in runs) * 1000
        tpot = statistics.median((r[1] - r[0]) / max(1, r[2] - 1) for r in runs) * 1000
        out = {"variant": name, "ttft_p50_ms": round(ttft, 1), "tpot_p50_ms": round(tpot, 2),
               "ttfts_ms": [round(r[0] * 1000, 1) for r in runs], "trace": trace}
        for role, urls in (("router", [dep.url]), ("context", dep.context_urls), ("generation", dep.generation_urls)):
            for url in urls:
                out[role] = {k: round(v, 2) for k, v in histogram_means(url).items()}
        out["texts"] = deploy_harness.greedy_texts(dep.url, PROMPTS, 16)
        out["first_logprobs"] = first_logprobs(dep.url, PROMPTS[0])
        print(json.dumps(out), flush=True)
        if args.keep_logs:
            for log in sorted(dep.log_dir.glob("*.log")):
                print(f"--- {name} {log.name}\n" + log.read_text(errors="replace")[-args.keep_logs:], flush=True)
        return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="builtin:tiny-llama")
    parser.add_argument("--variants", default="agg,off,auto,off_f32,auto_f32,off_thread")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-words", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--kv-max-tokens", type=int, default=0,
                        help="each server's KV pool in tokens (0: sized from free memory)")
    parser.add_argument("--dtype", default="bfloat16", help="the servers' dtype where the variant names none")
    parser.add_argument("--token-prompts", action="store_true",
                        help="prompts of random token ids (a model directory's tokenizer), as the load benchmarks")
    parser.add_argument("--keep-logs", type=int, default=0, help="print the last N characters of each log")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="diag-") as tmp:
        for name in args.variants.split(","):
            try:
                results[name] = run_variant(name, args, Path(tmp))
            except Exception as exc:  # the next variant still runs
                print(json.dumps({"variant": name, "error": f"{type(exc).__name__}: {exc}"[:3000]}), flush=True)
    texts = {name: r["texts"] for name, r in results.items()}
    print("SUMMARY", json.dumps({n: {"ttft_p50_ms": r["ttft_p50_ms"], "tpot_p50_ms": r["tpot_p50_ms"]}
                                 for n, r in results.items()}))
    print("TEXTS", json.dumps(texts))


if __name__ == "__main__":
    main()
