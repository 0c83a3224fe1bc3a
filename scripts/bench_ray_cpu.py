"""`pdserve launch --ray` against the one-host launcher on the same machine, same run: time to a
healthy router, and steady output tok/s under `pdserve-bench load` (docs/BENCHMARKS.md).

A two-node Ray cluster of this machine on loopback (ray.cluster_utils.Cluster, nodes with the
resources node_a and node_b, as tests/integration/test_ray.py) holds the Ray deployment: the
context server pinned to node A, the generation server to node B, the router on node A. The one-host
launch runs the same file with fixed urls. The two alternate (one-host, Ray, one-host, Ray, ...),
each launched fresh, timed from the launcher's start to the router's first 200 on /health, then
loaded by the same `pdserve-bench load` command (closed loop), then stopped with SIGINT.

    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 python scripts/bench_ray_cpu.py --repeat 3 --out bench-results/ray
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
LOAD = ["--concurrency", "8", "--ramp-s", "2", "--duration", "40", "--input-len", "128", "--output-len", "64",
        "--client-procs", "1", "--model", "builtin:tiny-story"]


# pdserve-bench, by the interpreter running this script (its console script may be another venv's)
BENCH = [sys.executable, "-c", "import sys; from pdserve_bench.cli import main; sys.exit(main())"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def config(folder: Path, placed_by_ray: bool) -> Path:
    cfg = yaml.safe_load((ROOT / "configs" / "disagg.yaml").read_text())
    cfg.update(port=free_port(), device="cpu", ray_actor_options={"resources": {"node_a": 1}})
    for section, node in (("context_servers", "node_a"), ("generation_servers", "node_b")):
        cfg[section]["ray_actor_options"] = {"resources": {node: 1}}
        cfg[section]["urls"] = [f"127.0.0.1:{free_port()}"]
        if placed_by_ray:
            del cfg[section]["urls"]
    path = folder / ("ray.yaml" if placed_by_ray else "onehost.yaml")
    path.write_text(yaml.safe_dump(cfg))
    return path


def measure(kind: str, path: Path, address: str, out: Path, run: int, load: bool) -> dict:
    from pdserve_bench.launch import wait_for_health

    url = f"http://127.0.0.1:{yaml.safe_load(path.read_text())['port']}"
    argv = [sys.executable, "-m", "server.cli", "launch", str(path), "--log-dir", str(path.parent / f"logs-{run}")]
    argv += ["--ray", address, "--name", f"bench{run}"] if kind == "ray" else []
    env = {**os.environ, **ENV}
    start = time.monotonic()
    with open(path.parent / f"launch-{kind}-{run}.log", "wb") as log:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        if not wait_for_health(url, 300, lambda: proc.poll() is None, interval_s=0.1):
            raise SystemExit(f"{kind}: not healthy; see {path.parent}")
        ready_s = time.monotonic() - start
        if not load:
            return {"kind": kind, "run": run, "ready_s": round(ready_s, 2)}
        load = subprocess.run([*BENCH, "load", "--deploy", f"{kind}={url}", *LOAD, "--out", str(out)], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=600)
        if load.returncode != 0:
            raise SystemExit(f"{kind}: load failed\n{load.stdout}\n{load.stderr}")
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
    record = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()][-1]
    return {"kind": kind, "run": run, "ready_s": round(ready_s, 2), **_figures(record)}


def _figures(record: dict) -> dict:
    flat = {**record, **record.get("results", {}), **record.get("figures", {})}
    keys = ("steady_output_tok_s", "output_tok_s", "ttft_p50_ms", "tpot_p50_ms", "errors")
    return {k: flat[k] for k in keys if k in flat}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", default="bench-results/ray")
    parser.add_argument("--startup-only", action="store_true", help="time the launches, run no load")
    args = parser.parse_args()
    os.environ.update(ENV)
    from ray.cluster_utils import Cluster

    node = {"num_cpus": 4, "node_ip_address": "127.0.0.1", "object_store_memory": 80 << 20}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "resources": {"node_a": 4},
                                                            "include_dashboard": False})
    cluster.add_node(**node, resources={"node_b": 4})
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for run in range(args.repeat):
                for kind in ("onehost", "ray"):
                    rows.append(measure(kind, config(Path(tmp), kind == "ray"), cluster.address, out, run,
                                        not args.startup_only))
                    print(json.dumps(rows[-1]), flush=True)
    finally:
        cluster.shutdown()
    summary = {kind: {k: round(statistics.median(r[k] for r in rows if r["kind"] == kind), 2)
                      for k in ("ready_s", "steady_output_tok_s") if all(k in r for r in rows)}
               for kind in ("onehost", "ray")}
    ratios = {k: round(summary["ray"][k] / summary["onehost"][k], 3) for k in summary["ray"]}
    # each Ray run against the one-host run just before it (the box's load drifts between pairs)
    pairs = {k: [round(r[k] / o[k], 3) for o, r in zip(rows[::2], rows[1::2], strict=True)] for k in summary["ray"]}
    print(json.dumps({"median": summary, "ray_over_onehost": ratios, "pairs": pairs,
                      "pairs_median": {k: statistics.median(v) for k, v in pairs.items()}}), flush=True)


if __name__ == "__main__":
    main()
