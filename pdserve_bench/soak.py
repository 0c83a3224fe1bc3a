"""CPU soak: many concurrent streams for minutes under KV pool pressure.

1. An aggregated server gives the reference text of every prompt (greedy, ignore_eos).
2. A disaggregated deployment with small pools: the context server's primary pool holds 1024 tokens
   and a host pool takes every evicted block (offload; replayed prefixes are onboarded), the
   generation server's pool holds far fewer tokens than 64 streams need (preemption), with a host
   pool too. Prompts share prefixes (reuse) and come back (onboard).
3. `--streams` clients stream through the router back to back for `--minutes`; every answer must be
   complete ([DONE]) and equal to the aggregated reference.
4. Every `--sample-s` seconds: each server's RSS and its pool (blocks in use, cached, free; offloads,
   onboards, preemptions). At the end: the figures, and whether RSS and pool usage stayed flat
   (the last third of the run against the second third).

    pdserve-bench soak --minutes 10 --streams 64

One record (request counts; RSS and blocks in use, middle vs last third), and the samples in
OUT/soak-samples.jsonl. Exit status 1 unless every answer was complete and equal.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import time
from pathlib import Path

import httpx
import psutil

from pdserve_bench import options
from pdserve_bench.launch import REPO, ServerUnderTest, server_urls

HELP = "many streams for minutes under KV pool pressure, every answer checked against aggregated"
TOPICS = ["rivers", "bridges", "tides", "comets", "glaciers", "lanterns", "orchards", "harbors"]
MAX_TOKENS = 48
PRESSURE = {
    "max_seq_len": 2048,
    "context_servers": {"max_batch_size": 16, "kv_cache_config": {
        "tokens_per_block": 32, "max_tokens": 1024, "enable_block_reuse": True, "host_cache_size": 64 << 20,
        "secondary_offload_min_priority": 0}},
    "generation_servers": {"max_batch_size": 64, "kv_cache_config": {
        "tokens_per_block": 32, "max_tokens": 1536, "enable_block_reuse": True, "host_cache_size": 64 << 20,
        "secondary_offload_min_priority": 0}},
}
SERVERS = ("ctx", "gen")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    options.add_common(parser, repeat=None, model=False)
    parser.add_argument("--model", default="builtin:tiny-llama", help="the model the started servers serve")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--sample-s", type=float, default=15.0, help="seconds between samples of RSS and pools")


def prompts() -> list[str]:
    """16 prompts: 8 topics x 2 endings, sharing a long common prefix (reuse, then onboard)."""
    base = "A soak test keeps a server busy for a long time and checks every answer. " * 4
    return [f"{base}Topic: {t}. Part {i}: write about {t}." for t in TOPICS for i in (1, 2)]


def reference_texts(model: str) -> dict[str, str]:
    overrides = {"model": model, "max_seq_len": 2048}
    with ServerUnderTest(REPO / "configs" / "aggregated.yaml", overrides=overrides) as url:
        return {p: _complete(url, p) for p in prompts()}


def _complete(url: str, prompt: str) -> str:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]


async def stream(client: httpx.AsyncClient, url: str, prompt: str) -> tuple[bool, str]:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True, "stream": True}
    texts, done = [], False
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            return False, f"HTTP {response.status_code}"
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                if "error" in event:
                    return False, event["error"]["message"]
                texts.append(event["choices"][0]["text"])
    return done, "".join(texts)


async def clients(url: str, refs: dict[str, str], streams: int, seconds: float, stats: dict) -> None:
    deadline = time.monotonic() + seconds
    order = list(refs)

    async def worker(i: int) -> None:
        n = i
        async with httpx.AsyncClient(timeout=300) as client:
            while time.monotonic() < deadline:
                prompt = order[n % len(order)]
                n += streams
                try:
                    done, text = await stream(client, url, prompt)
                except httpx.HTTPError as exc:
                    done, text = False, f"{type(exc).__name__}: {exc}"
                key = "ok" if done and text == refs[prompt] else ("mismatch" if done else "error")
                stats[key] = stats.get(key, 0) + 1
                if key != "ok" and len(stats.setdefault("examples", [])) < 5:
                    stats["examples"].append(text[:200])

    await asyncio.gather(*(worker(i) for i in range(streams)))


def listening_pid(root_pid: int, url: str) -> int:
    """The pid, among `root_pid`'s descendants, of the process listening on `url`'s port."""
    port = int(url.rsplit(":", 1)[1])
    for child in psutil.Process(root_pid).children(recursive=True):
        try:
            if any(c.laddr.port == port and c.status == psutil.CONN_LISTEN for c in child.net_connections("tcp")):
                return child.pid
        except psutil.Error:
            continue
    raise RuntimeError(f"no process of the deployment listens on {url}")


def sample(urls: dict[str, str], pids: dict[str, int]) -> dict:
    row: dict = {"t": time.monotonic()}
    for name in SERVERS:
        text = httpx.get(f"{urls[name]}/metrics", timeout=10).text
        metric = lambda n, lab="", text=text: _metric(text, n, lab)
        row[name] = {"rss_mib": psutil.Process(pids[name]).memory_info().rss / 2**20,
                     "in_use": metric("pdserve_kv_cache_blocks", 'level="primary",state="in_use"'),
                     "cached": metric("pdserve_kv_cache_blocks", 'level="primary",state="cached"'),
                     "host_used": metric("pdserve_kv_cache_blocks", 'level="secondary",state="cached"'),
                     "offloaded": metric("pdserve_kv_offloaded_blocks_total"),
                     "onboarded": metric("pdserve_kv_onboarded_blocks_total"),
                     "preemptions": metric("pdserve_num_preemptions_total")}
    return row


def _metric(text: str, name: str, labels: str = "") -> float:
    samples = re.findall(rf"^{name}(\{{[^}}]*\}})? (\S+)$", text, re.M)
    return sum(float(v) for lab, v in samples if labels in (lab or ""))


async def monitor(urls: dict[str, str], pids: dict[str, int], every_s: float, seconds: float, rows: list) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        rows.append(await asyncio.to_thread(sample, urls, pids))
        print(json.dumps({k: ({m: round(v, 1) for m, v in r.items()} if isinstance(r, dict) else round(r, 1))
                          for k, r in rows[-1].items()}), flush=True)
        await asyncio.sleep(every_s)  # the sampling period


def flat(rows: list[dict], server: str, key: str) -> dict:
    third = max(1, len(rows) // 3)
    middle = [r[server][key] for r in rows[third:2 * third]] or [0.0]
    last = [r[server][key] for r in rows[-third:]]
    return {"middle_mean": round(statistics.mean(middle), 1), "last_mean": round(statistics.mean(last), 1),
            "max": round(max(r[server][key] for r in rows), 1)}


def soak(args: argparse.Namespace, refs: dict[str, str]) -> tuple[dict, list, float]:
    """Run the disaggregated deployment under load: (request counts, samples, seconds)."""
    overrides = {**PRESSURE, "model": args.model}
    server = ServerUnderTest(REPO / "configs" / "disagg.yaml", overrides=overrides)
    with server as url:
        urls = {"ctx": server_urls(server.deployment, "context_servers")[0],
                "gen": server_urls(server.deployment, "generation_servers")[0]}
        pids = {name: listening_pid(server.pid, urls[name]) for name in SERVERS}
        stats: dict = {}
        rows: list = []
        seconds = args.minutes * 60
        started = time.monotonic()

        async def run_all() -> None:
            await asyncio.gather(clients(url, refs, args.streams, seconds, stats),
                                 monitor(urls, pids, args.sample_s, seconds, rows))

        asyncio.run(run_all())
        rows.append(sample(urls, pids))
        return stats, rows, time.monotonic() - started


def run(args: argparse.Namespace) -> int:
    refs = reference_texts(args.model)
    stats, rows, elapsed = soak(args, refs)
    summary = {"minutes": round(elapsed / 60, 1), "streams": args.streams, "requests": stats,
               "rss_mib": {s: flat(rows, s, "rss_mib") for s in SERVERS},
               "in_use_blocks": {s: flat(rows, s, "in_use") for s in SERVERS},
               "final": rows[-1]}
    print(json.dumps(summary, indent=1))
    figures = {"minutes": elapsed / 60, **{f"requests_{k}": stats.get(k, 0) for k in ("ok", "mismatch", "error")}}
    for name in SERVERS:
        for key in ("rss_mib", "in_use_blocks"):
            figures |= {f"{name}_{key}_{part}": value for part, value in summary[key][name].items()}
    config = {"model": args.model, "streams": args.streams, "minutes": args.minutes, "sample_s": args.sample_s,
              "deployment": "configs/disagg.yaml", "pressure": PRESSURE}
    options.writer(args).write("soak", config, figures)
    if not args.no_record:
        out: Path = args.out
        out.mkdir(parents=True, exist_ok=True)
        with (out / "soak-samples.jsonl").open("a") as samples:
            samples.writelines(json.dumps(row) + "\n" for row in rows)
    return 0 if stats.get("ok") and not stats.get("mismatch") and not stats.get("error") else 1
