"""CPU soak (issue 11 item 10): 64 concurrent streams for 10 minutes under KV pool pressure.

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

    .venv/bin/python scripts/soak.py --minutes 10 --streams 64 --out soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path.insert(0, str(TESTS))

import deploy_harness as dh  # noqa: E402

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


def prompts() -> list[str]:
    """16 prompts: 8 topics x 2 endings, sharing a long common prefix (reuse, then onboard)."""
    base = "A soak test keeps a server busy for a long time and checks every answer. " * 4
    return [f"{base}Topic: {t}. Part {i}: write about {t}." for t in TOPICS for i in (1, 2)]


def reference_texts(tmp: Path) -> dict[str, str]:
    tmp.mkdir(parents=True, exist_ok=True)
    with dh.launched("aggregated.yaml", tmp, {"max_seq_len": 2048}) as agg:
        return {p: _complete(agg.url, p) for p in prompts()}


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


def sample(dep: dh.Deployment, pids: dict[str, int]) -> dict:
    row = {"t": time.monotonic()}
    for name, url in (("ctx", dep.context_urls[0]), ("gen", dep.generation_urls[0])):
        text = httpx.get(f"{url}/metrics", timeout=10).text
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


async def monitor(dep: dh.Deployment, pids: dict[str, int], every_s: float, seconds: float, rows: list) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        rows.append(await asyncio.to_thread(sample, dep, pids))
        print(json.dumps({k: ({m: round(v, 1) for m, v in r.items()} if isinstance(r, dict) else round(r, 1))
                          for k, r in rows[-1].items()}), flush=True)
        await asyncio.sleep(every_s)


def flat(rows: list[dict], server: str, key: str) -> dict:
    third = max(1, len(rows) // 3)
    middle = [r[server][key] for r in rows[third:2 * third]] or [0.0]
    last = [r[server][key] for r in rows[-third:]]
    return {"middle_mean": round(statistics.mean(middle), 1), "last_mean": round(statistics.mean(last), 1),
            "max": round(max(r[server][key] for r in rows), 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--sample-s", type=float, default=15.0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        refs = reference_texts(Path(tmp) / "agg")
        (Path(tmp) / "pair").mkdir()
        with dh.launched("disagg.yaml", Path(tmp) / "pair", PRESSURE) as dep:
            pids = {"ctx": dep.server_pids("context")[0], "gen": dep.server_pids("generation")[0]}
            stats: dict = {}
            rows: list = []
            seconds = args.minutes * 60
            started = time.monotonic()

            async def run() -> None:
                await asyncio.gather(clients(dep.url, refs, args.streams, seconds, stats),
                                     monitor(dep, pids, args.sample_s, seconds, rows))

            asyncio.run(run())
            rows.append(sample(dep, pids))
            elapsed = time.monotonic() - started
    summary = {"minutes": round(elapsed / 60, 1), "streams": args.streams, "requests": stats,
               "rss_mib": {s: flat(rows, s, "rss_mib") for s in ("ctx", "gen")},
               "in_use_blocks": {s: flat(rows, s, "in_use") for s in ("ctx", "gen")},
               "final": rows[-1]}
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.write_text(json.dumps({"summary": summary, "samples": rows}, indent=1))
    return 0 if stats.get("ok") and not stats.get("mismatch") and not stats.get("error") else 1


if __name__ == "__main__":
    sys.exit(main())
