"""Two hosts: context and generation servers in separate network namespaces, a 2 s partition
during transfers.

Namespaces (`ip netns`, veth pairs), as two machines and a management network would be:
    ctx ns  10.213.0.1 ==== data link ==== 10.213.0.2  gen ns (generation server + router)
    ctx ns  10.213.1.2 -- mgmt -- 10.213.1.1 test   10.213.2.1 -- mgmt -- 10.213.2.2 gen ns
The router reaches the context server and the generation server pulls KV over the data link, by IP;
the link is shaped to 40 Mbit/s (tc tbf) so that each transfer takes a while, as between machines.
With requests and their KV transfers under way the data link goes down for 2 s, then up. Every
request must end, completed or failed with an honest HTTP error; leases are reaped, no block stays
in use on either server, and service resumes once the link is back.

Needs root and `ip netns`; skips (saying why) only where namespaces cannot be made. CI runs as root
on a machine like this one, so it runs there.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import deploy_harness as dh
import httpx
import pytest
import yaml
from waiting import wait_until

from pdserve_bench.launch import wait_for_health

TOKEN = "two-hosts-test-token-0123456789abcdef"
TAG = f"{os.getpid() % 100000}"
CTX_NS, GEN_NS = f"pdctx{TAG}", f"pdgen{TAG}"
CTX_IP, GEN_IP = "10.213.0.1", "10.213.0.2"  # data link
CTX_MGMT, GEN_MGMT = "10.213.1.2", "10.213.2.2"  # what the test reaches them by
DATA_LINK = f"vd{TAG}a"  # the context side of the data link
PARTITION_S = 2.0
CTX_LEASE_MS, GEN_PULL_MS = 5000, 3000
RATE = "40mbit"  # the data link, context -> generation (KV chunks)
REQUESTS = 4


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def netns_problem() -> str | None:
    if os.geteuid() != 0:
        return "needs root (ip netns)"
    probe = f"pdprobe{TAG}"
    try:
        sh("ip", "netns", "add", probe)
    except (OSError, subprocess.CalledProcessError) as exc:
        return f"ip netns is not permitted here: {getattr(exc, 'stderr', '') or exc}"
    sh("ip", "netns", "del", probe)
    return None


def build_network() -> None:
    for ns in (CTX_NS, GEN_NS):
        sh("ip", "netns", "add", ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
    links = [  # (end in ns A, ns A or None for the test's, address A, end in ns B, ns B, address B)
        (DATA_LINK, CTX_NS, CTX_IP, f"vd{TAG}b", GEN_NS, GEN_IP, 24),
        (f"vm{TAG}a", None, "10.213.1.1", f"vm{TAG}b", CTX_NS, CTX_MGMT, 24),
        (f"vn{TAG}a", None, "10.213.2.1", f"vn{TAG}b", GEN_NS, GEN_MGMT, 24),
    ]
    for a, ns_a, ip_a, b, ns_b, ip_b, bits in links:
        sh("ip", "link", "add", a, "type", "veth", "peer", "name", b)
        for end, ns, ip in ((a, ns_a, ip_a), (b, ns_b, ip_b)):
            if ns is not None:
                sh("ip", "link", "set", end, "netns", ns)
            prefix = ["ip", "-n", ns] if ns is not None else ["ip"]
            sh(*prefix, "addr", "add", f"{ip}/{bits}", "dev", end)
            sh(*prefix, "link", "set", end, "up")
    try:  # slow transfers make the partition hit them; without tc's tbf they are just quicker
        sh("ip", "netns", "exec", CTX_NS, "tc", "qdisc", "add", "dev", DATA_LINK, "root", "tbf", "rate", RATE,
           "burst", "64kb", "latency", "2s")
    except (OSError, subprocess.CalledProcessError) as exc:
        print(f"data link not shaped (tc tbf unavailable: {getattr(exc, 'stderr', '') or exc})")


def tear_down_network() -> None:
    for ns in (CTX_NS, GEN_NS):  # deleting a namespace deletes its veth ends, and so their peers
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def write(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def server_configs(tmp: Path) -> tuple[Path, Path, Path]:
    common = {"model": "builtin:tiny-llama", "max_seq_len": 2048, "drain_timeout_s": 2,
              "kv_cache_config": {"tokens_per_block": 32, "max_tokens": 8192}}
    ctx = write(tmp / "ctx.yaml", {**common, "hostname": "0.0.0.0", "port": 8001, "cache_transceiver_config": {
        "host": CTX_IP, "kv_transfer_timeout_ms": CTX_LEASE_MS}})
    gen = write(tmp / "gen.yaml", {**common, "hostname": "0.0.0.0", "port": 8002, "context_urls": [f"{CTX_IP}:8001"],
                                   "cache_transceiver_config": {"kv_transfer_timeout_ms": GEN_PULL_MS}})
    router = write(tmp / "deployment.yaml", {
        "model": "builtin:tiny-llama", "hostname": GEN_MGMT, "port": 8000, "drain_timeout_s": 2,
        "context_servers": {"num_instances": 1, "urls": [f"{CTX_IP}:8001"]},
        "generation_servers": {"num_instances": 1, "urls": [f"{GEN_IP}:8002"]}})
    return ctx, gen, router


def logs(tmp: Path) -> str:
    """The last lines each server wrote (for a failure's message)."""
    return "\n".join(f"--- {n}\n" + (tmp / f"{n}.log").read_text()[-3000:] for n in ("ctx", "gen", "router"))


@contextmanager
def two_hosts(tmp: Path) -> Iterator[dict[str, str]]:
    problem = netns_problem()
    if problem is not None:
        pytest.skip(problem)
    build_network()
    procs: list[subprocess.Popen] = []
    env = {**os.environ, "PDSERVE_AUTH_TOKEN": TOKEN, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": "1"}
    try:
        ctx, gen, router = server_configs(tmp)
        for ns, argv, name in ((CTX_NS, ["serve", "--config", str(ctx), "--role", "context"], "ctx"),
                               (GEN_NS, ["serve", "--config", str(gen), "--role", "generation"], "gen"),
                               (GEN_NS, ["router", "--config", str(router)], "router")):
            with open(tmp / f"{name}.log", "wb") as log:
                procs.append(subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "server.cli", *argv],
                                              cwd=dh.ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
        urls = {"ctx": f"http://{CTX_MGMT}:8001", "gen": f"http://{GEN_MGMT}:8002", "router": f"http://{GEN_MGMT}:8000"}
        for name, url in urls.items():
            alive = lambda: all(p.poll() is None for p in procs)
            assert wait_for_health(url, 180, alive), f"{name} not healthy\n" + logs(tmp)
        yield urls
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        tear_down_network()


def metric(url: str, name: str, labels: str = "") -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and labels in line and not line.startswith("#"))


def partition(seconds: float) -> None:
    """The data link down for `seconds`: the outage itself is what the test is about."""
    sh("ip", "-n", CTX_NS, "link", "set", DATA_LINK, "down")
    time.sleep(seconds)
    sh("ip", "-n", CTX_NS, "link", "set", DATA_LINK, "up")


def test_partition_during_transfers_every_request_ends_and_nothing_leaks(tmp_path):
    with two_hosts(tmp_path) as urls:
        router = urls["router"]
        body = {"prompt": "Two hosts share the KV of one request. " * 40, "max_tokens": 16, "temperature": 0.0,
                "ignore_eos": True}  # ~1000 prompt tokens: 2 MiB of KV, ~0.4 s on the shaped link
        first = httpx.post(f"{router}/v1/completions", json=body, timeout=60)
        assert first.status_code == 200, f"{first.status_code} {first.text}\n" + logs(tmp_path)
        reference = first.json()["choices"][0]["text"]
        outcomes: list[tuple[int, str]] = []

        def one(i: int) -> None:
            request = {**body, "prompt": f"[{i}] " + body["prompt"]}
            try:
                response = httpx.post(f"{router}/v1/completions", json=request, timeout=120)
                detail = response.json()["error"]["message"] if response.status_code != 200 else ""
                outcomes.append((response.status_code, detail))
            except httpx.HTTPError as exc:
                outcomes.append((0, f"{type(exc).__name__}: {exc}"))

        pulled = metric(urls["gen"], "pdserve_kv_transfer_seconds_count")
        threads = [threading.Thread(target=one, args=(i,)) for i in range(REQUESTS)]
        for t in threads:
            t.start()
        wait_until(lambda: metric(urls["gen"], "pdserve_kv_transfer_seconds_count") > pulled, 30, interval_s=0.02,
                   what="the first transfer done")  # the next ones are under way
        started = time.monotonic()
        partition(PARTITION_S)
        for t in threads:
            t.join(150)
        ended_s = time.monotonic() - started
        assert not any(t.is_alive() for t in threads), "a request hung"
        assert len(outcomes) == REQUESTS
        for status, detail in outcomes:  # completed, or failed with an HTTP error that says what failed
            assert status == 200 or (status in (502, 503, 504) and detail), (status, detail)

        # leases reaped, nothing in use on either side, and service resumes over the link
        for url in (urls["ctx"], urls["gen"]):
            wait_until(lambda u=url: metric(u, "pdserve_kv_cache_blocks", 'state="in_use"') == 0,
                       CTX_LEASE_MS / 1000 + 10, what=f"no block in use on {url}")
        resumed = time.monotonic()
        wait_until(lambda: httpx.get(f"{router}/health", timeout=5).status_code == 200, 30, what="router healthy")
        after = httpx.post(f"{router}/v1/completions", json=body, timeout=60)
        assert after.status_code == 200 and after.json()["choices"][0]["text"] == reference
        ok = sum(status == 200 for status, _ in outcomes)
        failures = metric(urls["gen"], "pdserve_kv_transfer_failures_total")
        expired = metric(urls["ctx"], "pdserve_kv_transfer_lease_expired_total")
        print(f"transfer failures on the generation server: {failures:g}, leases expired on the context "
              f"server: {expired:g}; outcomes {outcomes}")
        print(f"partition {PARTITION_S:g} s: {ok}/{REQUESTS} completed, {REQUESTS - ok} failed honestly; all ended "
              f"{ended_s:.1f} s after it began; service back {time.monotonic() - resumed:.1f} s after the checks")
