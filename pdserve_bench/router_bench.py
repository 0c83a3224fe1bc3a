"""Router overhead: time to the first SSE event through the router against the backends alone.

The context and generation "servers" here answer at once (a fixed context answer; a 3-event
stream), so what remains is the router's own work: its HTTP front end, the context leg's HTTP
exchange, the opening events it makes from the context answer, and the relay. Baseline in the same
run: the same client posting straight to the fake context server. Also recorded: the router
process's CPU per request (both legs' client work included) and its resident memory after the run,
and the time and memory of importing the router's app in a fresh interpreter, and the CPU of the
router's HTTP client alone per round of its two legs.

    pdserve-bench router [--requests 500]

One record: medians over the requests (each request is one sample; `--repeat` is not used).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time

import httpx
import uvicorn

from pdserve_bench import options
from pdserve_bench.launch import free_ports, wait_for_health

HELP = "router overhead: time to the first SSE event through the router against the backend alone"

PROMPT = list(range(256))
PARAMS = {"request_type": "context_only", "ctx_request_id": "cmpl-bench", "ctx_endpoint": "tcp://127.0.0.1:1",
          "ctx_epoch": "e", "first_gen_tokens": [5], "prompt_token_ids": PROMPT, "ctx_cached_tokens": 0}
CONTEXT_ANSWER = json.dumps({
    "id": "cmpl-bench", "object": "text_completion", "created": 1, "model": "m",
    "choices": [{"index": 0, "text": " hi", "logprobs": None, "finish_reason": None, "disaggregated_params": PARAMS}],
    "usage": {"prompt_tokens": 256, "completion_tokens": 1, "total_tokens": 257}}).encode()
EVENT = b'data: {"choices":[{"index":0,"text":"a"}]}\n\n'


async def _read_body(receive) -> bytes:
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            return body


async def instant_backend(scope, receive, send) -> None:
    """ASGI app: a GET gets 200 `{}`; a streaming request 3 events and [DONE]; any other the context answer."""
    if scope["type"] != "http":
        return
    body = await _read_body(receive)
    if scope["method"] == "GET":  # /health, and the router's dashboard scraping /metrics
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})
        return
    if json.loads(body).get("stream"):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for _ in range(3):
            await send({"type": "http.response.body", "body": EVENT, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": CONTEXT_ANSWER})


def _serve_backend(port: int) -> None:
    uvicorn.run(instant_backend, host="127.0.0.1", port=port, log_level="warning", lifespan="off")


def first_event_ms(client: httpx.Client, url: str, body: dict) -> tuple[float, float]:
    """(ms to the first `data:` line, or to the whole body when there is none; ms to the end)."""
    start, first = time.perf_counter(), None
    with client.stream("POST", url, json=body) as response:
        for line in response.iter_lines():
            if first is None and line.startswith("data: "):
                first = time.perf_counter()
    end = time.perf_counter()
    return ((first or end) - start) * 1e3, (end - start) * 1e3


IMPORT_PROBE = ("import time; t = time.perf_counter(); import server.router.app; t = time.perf_counter() - t; "
                "print(t, next(int(x.split()[1]) for x in open('/proc/self/status') if x.startswith('VmRSS')) / 1024)")
# the router in an interpreter of its own that imports only what the router does (not this bench)
ROUTER = ("import sys, uvicorn; from server.config.router import RouterConfig; "
          "from server.router.app import create_router_app; "
          "ctx, gen, port = sys.argv[1:]; settings = RouterConfig(context_urls=(ctx,), generation_urls=(gen,)); "
          "uvicorn.run(create_router_app(settings), host='127.0.0.1', port=int(port), log_level='warning', "
          "access_log=False)")


def import_cost() -> tuple[float, float]:
    """(seconds to import the router's app, RSS MiB of that interpreter then), fresh process, median of 5."""
    runs = [subprocess.run([sys.executable, "-c", IMPORT_PROBE], capture_output=True, text=True, check=True)
            for _ in range(5)]
    seconds, mib = zip(*((float(a), float(b)) for a, b in (r.stdout.split() for r in runs)), strict=True)
    return statistics.median(seconds), statistics.median(mib)


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def client_cpu_ms(url: str, rounds: int) -> float:
    """CPU ms of the router's HTTP client (server/router/http_client.py) per round of the router's
    two legs, alone in this process: one JSON POST (the context leg) and one streamed POST read to
    its end (the generation leg) to the instant backend, on one keep-alive connection."""
    import asyncio

    from server.router.http_client import HttpClient

    async def rounds_cpu() -> float:
        client = HttpClient()
        ctx_body, gen_body = {"prompt": PROMPT, "stream": False}, {"prompt": PROMPT, "stream": True}

        async def one() -> None:
            (await client.request("POST", f"{url}/v1/completions", json=ctx_body, timeout=30)).json()
            stream = await client.stream("POST", f"{url}/v1/completions", json=gen_body, timeout=30)
            async for _ in stream.aiter_raw():
                pass
            await stream.aclose()
        for _ in range(50):
            await one()
        start = time.process_time()
        for _ in range(rounds):
            await one()
        spent = time.process_time() - start
        await client.aclose()
        return spent

    return asyncio.run(rounds_cpu()) * 1e3 / rounds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=500)
    options.add_common(parser, repeat=None, model=False)


def run(args: argparse.Namespace) -> int:
    out = options.writer(args)
    router_port, ctx_port, gen_port = free_ports(3)
    procs = [mp.Process(target=_serve_backend, args=(ctx_port,), daemon=True),
             mp.Process(target=_serve_backend, args=(gen_port,), daemon=True)]
    for proc in procs:
        proc.start()
    router_proc = subprocess.Popen([sys.executable, "-c", ROUTER, f"127.0.0.1:{ctx_port}", f"127.0.0.1:{gen_port}",
                                    str(router_port)])
    router, context = f"http://127.0.0.1:{router_port}", f"http://127.0.0.1:{ctx_port}"
    try:
        alive = lambda: router_proc.poll() is None and all(p.is_alive() for p in procs)
        if not wait_for_health(router, 60.0, alive):
            raise SystemExit("router did not become healthy")
        body = {"prompt": PROMPT, "max_tokens": 4, "stream": True}
        with httpx.Client(timeout=30) as client:
            for _ in range(50):  # warm-up: connections, imports, caches
                first_event_ms(client, f"{router}/v1/completions", body)
                first_event_ms(client, f"{context}/v1/completions", {**body, "stream": False})
            via, direct = [], []
            router_cpu = cpu_s(router_proc.pid)  # the router's health rounds (1 s apart) are included
            for _ in range(args.requests):  # interleaved, so both see the same machine
                via.append(first_event_ms(client, f"{router}/v1/completions", body))
                direct.append(first_event_ms(client, f"{context}/v1/completions", {**body, "stream": False}))
        router_cpu = cpu_s(router_proc.pid) - router_cpu
        router_rss = rss_mib(router_proc.pid)
        client_ms = client_cpu_ms(context, args.requests * 4)
    finally:
        router_proc.terminate()
        router_proc.wait(10)
        for proc in procs:
            proc.terminate()
            proc.join(5)
    med = statistics.median
    figures = {"first_event_ms": med(v[0] for v in via), "stream_ms": med(v[1] for v in via),
               "direct_ms": med(d[1] for d in direct)}
    figures["overhead_ms"] = figures["first_event_ms"] - figures["direct_ms"]
    figures["router_cpu_ms_per_request"] = router_cpu * 1e3 / args.requests
    figures["router_rss_mib"] = router_rss
    figures["client_cpu_ms_per_round"] = client_ms
    figures["import_s"], figures["import_rss_mib"] = import_cost()
    print(f"through the router: first event {figures['first_event_ms']:.2f} ms, whole stream "
          f"{figures['stream_ms']:.2f} ms (median of {args.requests})")
    print(f"context backend alone (its answer): {figures['direct_ms']:.2f} ms")
    print(f"router overhead to the first event: {figures['overhead_ms']:.2f} ms")
    print(f"the router's HTTP client alone: {client_ms:.3f} ms CPU per round (a JSON leg and a streamed leg)")
    print(f"router CPU per request: {figures['router_cpu_ms_per_request']:.3f} ms; router RSS after the run: "
          f"{router_rss:.0f} MiB; importing its app: {figures['import_s']:.2f} s, {figures['import_rss_mib']:.0f} MiB")
    out.write("router", {"requests": args.requests, "prompt_tokens": len(PROMPT)}, figures)
    return 0
