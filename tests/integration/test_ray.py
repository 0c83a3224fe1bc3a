"""`pdserve launch --ray` on a Ray cluster of this machine (ray.cluster_utils.Cluster).

Node A advertises the custom resource `node_a`, node B `node_b`, node C `node_c` (B and C also one
`gen` each); the deployments pin their servers with `ray_actor_options.resources`. Every Ray
address and all traffic stay on 127.0.0.1 (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 makes Ray use
loopback as each node's address). One cluster
serves the whole module; `pair` is one deployment that several tests use in file order (placement,
replay, a SIGKILLed server, a lost node, then SIGINT), `tp` another (a TP=2 context server, detached, then
`pdserve ray down`).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import deploy_harness as dh
import hf_reference
import httpx
import psutil
import pytest
import yaml
from transformers import AutoTokenizer
from waiting import wait_until

from pdserve_bench.launch import wait_for_health
from server.deploy.supervisor import health
from server.models.builtin import resolve_model

ROOT = Path(__file__).resolve().parents[2]
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
NAMESPACE = "pdserve"
TOPICS = ["astronomy", "cooking", "gardening", "history", "music", "sailing"]
FILLER = "The system should keep the answer short, clear and correct, and it should cite the facts it uses. "
PROMPTS = [f"Topic: {t}. " + FILLER * 4 + " Now answer briefly:" for t in TOPICS]
PAYLOAD = {"max_tokens": 16, "temperature": 0.0, "ignore_eos": True}
READY_S = 180.0


@dataclass
class RayNodes:
    address: str
    nodes: object  # ray.cluster_utils.Cluster
    node_c: object  # the node that test_a_lost_node_takes_its_server_... removes


@pytest.fixture(scope="module")
def cluster():
    """Ray nodes on loopback: A (the head), B and C; B and C each have one `gen` (a generation server's
    resource, so that the pair's two generation servers land one on each). The test process is a
    driver too."""
    with pytest.MonkeyPatch.context() as patch:
        for key, value in LOOPBACK_ENV.items():
            patch.setenv(key, value)
        import ray
        from ray.cluster_utils import Cluster

        node = {"num_cpus": 4, "node_ip_address": "127.0.0.1", "object_store_memory": 80 << 20}
        nodes = Cluster(initialize_head=True, head_node_args={**node, "resources": {"node_a": 4},
                                                              "include_dashboard": False})
        nodes.add_node(**node, resources={"node_b": 4, "gen": 1})
        node_c = nodes.add_node(**{**node, "num_cpus": 1}, resources={"node_c": 1, "gen": 1})
        ray.init(address=nodes.address, namespace=NAMESPACE, log_to_driver=False)
        try:
            yield RayNodes(nodes.address, nodes, node_c)
        finally:
            ray.shutdown()
            nodes.shutdown()


def node_ids() -> dict[str, str]:
    import ray

    return {next(r for r in ("node_a", "node_b", "node_c") if r in n["Resources"]): n["NodeID"]
            for n in ray.nodes() if n["Alive"]}


def actors(name: str) -> list[str]:
    import ray

    return sorted(n for n in ray.util.list_named_actors() if n.startswith(f"{name}/"))


def info(name: str) -> dict:
    import ray

    return ray.get(ray.get_actor(name).info.remote(), timeout=60)


def write_config(tmp_path: Path, overrides: dict) -> tuple[Path, dict]:
    """configs/disagg_host_offload.yaml on tiny-llama without server urls (Ray places them)."""
    cfg = yaml.safe_load((ROOT / "configs" / "disagg_host_offload.yaml").read_text())
    cfg = dh._merge({**cfg, "model": "builtin:tiny-llama", "port": dh.free_port(), "device": "cpu"}, overrides)
    for section in ("context_servers", "generation_servers"):
        cfg[section].pop("urls")
    path = tmp_path / "deployment.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, cfg


def pinned(ctx_node: str, gen_node: str, **ctx: object) -> dict:
    return {"ray_actor_options": {"resources": {"node_a": 1}},
            "context_servers": {"ray_actor_options": {"resources": {ctx_node: 1}}, **ctx},
            "generation_servers": {"ray_actor_options": {"resources": {gen_node: 1}}}}


def pdserve(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "server.cli", *args], cwd=ROOT, env={**os.environ, **LOOPBACK_ENV},
                          capture_output=True, text=True, timeout=timeout_s)


def start_launch(cluster, path: Path, name: str, *extra: str) -> subprocess.Popen:
    log = open(path.parent / f"launch-{name}.log", "ab")  # noqa: SIM115 - the process writes it after we return
    return subprocess.Popen([sys.executable, "-m", "server.cli", "launch", str(path), "--ray", cluster.address,
                             "--name", name, "--log-dir", str(path.parent / "logs"), *extra], cwd=ROOT,
                            env={**os.environ, **LOOPBACK_ENV}, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def launch_log(path: Path, name: str) -> str:
    return (path.parent / f"launch-{name}.log").read_text(errors="replace")


def wait_ready(proc: subprocess.Popen, url: str, path: Path, name: str) -> None:
    if not wait_for_health(url, READY_S, lambda: proc.poll() is None, interval_s=0.5):
        raise AssertionError(f"not ready (launcher rc {proc.poll()}):\n{launch_log(path, name)}")


async def _complete(client: httpx.AsyncClient, url: str, prompt: str) -> dict:
    response = await client.post(f"{url}/v1/completions", json={"prompt": prompt, **PAYLOAD}, timeout=180)
    assert response.status_code == 200, response.text
    return response.json()


def texts(url: str, concurrent: bool = False) -> list[dict]:
    async def run() -> list[dict]:
        async with httpx.AsyncClient() as client:
            if concurrent:
                return await asyncio.gather(*(_complete(client, url, p) for p in PROMPTS))
            return [await _complete(client, url, p) for p in PROMPTS]
    return asyncio.run(run())


def replay(url: str, reference: list[str]) -> None:
    """Once one by one, then twice all at once: exact, and the replays hit the prefix cache."""
    assert [b["choices"][0]["text"] for b in texts(url)] == reference
    for _ in range(2):
        again = texts(url, concurrent=True)
        assert [b["choices"][0]["text"] for b in again] == reference
        assert all(b["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 for b in again)


def server_pids(path: Path) -> list[int]:
    """Processes that run a server or router of the deployment file's placed copies."""
    folder = str(path.parent / "logs")
    out = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if "server.cli" in cmd and f"--config {folder}" in cmd:  # not the launcher: it has --log-dir
            out.append(proc.pid)
    return out


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith((f"{name} ", f"{name}{{")))


def alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def process_tree(pid: int) -> list[int]:
    return [pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))]


@dataclass
class Launched:
    proc: subprocess.Popen
    path: Path
    url: str
    address: str


@pytest.fixture(scope="module")
def reference() -> list[str]:
    model_dir = resolve_model("builtin:tiny-llama")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [tokenizer.decode(hf_reference.hf_greedy_ignore_eos(model_dir, tokenizer.encode(p), 16),
                             skip_special_tokens=True) for p in PROMPTS]


@pytest.fixture(scope="module")
def pair(cluster, tmp_path_factory):
    """Context server on node A, generation servers on nodes B and C, the router on node A."""
    overrides = pinned("node_a", "gen")
    overrides["generation_servers"]["num_instances"] = 2
    path, cfg = write_config(tmp_path_factory.mktemp("pair"), overrides)
    proc = start_launch(cluster, path, "pair")
    try:
        wait_ready(proc, f"http://127.0.0.1:{cfg['port']}", path, "pair")
        yield Launched(proc, path, f"http://127.0.0.1:{cfg['port']}", cluster.address)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=120)


def test_servers_run_on_the_nodes_their_resources_name(pair):
    nodes = node_ids()
    assert actors("pair") == ["pair/context-0", "pair/generation-0", "pair/generation-1", "pair/router"]
    ctx, gen0, gen1, router = (info(f"pair/{n}") for n in ("context-0", "generation-0", "generation-1", "router"))
    assert (ctx["node_id"], router["node_id"]) == (nodes["node_a"], nodes["node_a"])
    assert {gen0["node_id"], gen1["node_id"]} == {nodes["node_b"], nodes["node_c"]}  # one `gen` on each
    for server in (ctx, gen0, gen1):  # the same-GPU decision reads Ray's node id, not the shared hostname
        process = psutil.Process(server["pid"])
        assert process.environ()["PDSERVE_NODE_ID"] == server["node_id"]
        assert process.nice() == 0  # not the niceness Ray gives its workers
        assert server["health_url"].startswith("http://127.0.0.1:")
    token = psutil.Process(ctx["pid"]).environ()["PDSERVE_AUTH_TOKEN"]  # made by the launcher
    folder = pair.path.parent / "logs" / "pair"  # what the nodes wrote: the placed file, without the token
    assert oct(folder.stat().st_mode & 0o777) == "0o700"
    for name in ("context-0", "generation-0", "generation-1", "router"):
        placed = folder / f"{name}.yaml"
        assert oct(placed.stat().st_mode & 0o777) == "0o600" and token not in placed.read_text()
    assert len(token) == 64 and token not in pair.path.read_text()
    status = pdserve("ray", "status", "pair", "--address", pair.address)
    assert status.returncode == 0, status.stderr
    lines = {line.split()[0]: line for line in status.stdout.splitlines()[1:]}
    for name, server in (("context-0", ctx), ("generation-0", gen0), ("generation-1", gen1)):
        assert f"127.0.0.1/{server['node_id'][:12]}" in lines[name] and lines[name].endswith("200 ok")
        assert httpx.get(server["health_url"]).json()["epoch"] in lines[name]


def test_replay_under_host_offload_matches_transformers(pair, reference):
    replay(pair.url, reference)
    ctx = info("pair/context-0")["health_url"].removesuffix("/health")
    assert metric(ctx, "pdserve_kv_offloaded_blocks_total") > 0
    assert metric(ctx, "pdserve_kv_onboarded_blocks_total") > 0


def generation_on(node: str) -> dict:
    return next(g for g in (info("pair/generation-0"), info("pair/generation-1")) if g["node_id"] == node_ids()[node])


def test_a_killed_server_serves_again_on_its_node(pair, reference):
    path, url = pair.path, pair.url
    before = generation_on("node_b")
    epoch = httpx.get(before["health_url"]).json()["epoch"]
    os.kill(before["pid"], signal.SIGKILL)
    killed = time.monotonic()
    wait_until(lambda: health(before["health_url"], 1.0), 30, what="generation-0 healthy again with a new epoch",
               interval_s=0.25, check=lambda got: got[0] == 200 and got[1]["epoch"] != epoch,
               on_timeout=lambda: launch_log(path, "pair"))
    assert time.monotonic() - killed < 30
    after = info(f"pair/{before['name']}")
    assert after["restarted"] and after["pid"] != before["pid"] and after["node_id"] == before["node_id"]
    wait_until(lambda: health(f"{url}/health", 1.0)[0] == 200, 30, what="the router healthy again")
    assert [b["choices"][0]["text"] for b in texts(url)] == reference
    wait_until(lambda: f"{before['name']} is back" in launch_log(path, "pair"), 15,
               what="the launcher reporting the server back", on_timeout=lambda: launch_log(path, "pair"))
    assert "restarted by Ray, epoch" in launch_log(path, "pair")


def all_servers_healthy(url: str) -> bool:
    """The router sees every server of the deployment healthy (its /health lists each)."""
    servers = httpx.get(f"{url}/health", timeout=5).json().get("servers", {})
    return bool(servers) and all(s["healthy"] for s in servers.values())


def test_a_lost_node_takes_its_server_and_the_router_serves_with_the_rest(cluster, pair, reference):
    # the server an earlier test killed is back in the router's view too (else the lost one would be
    # the only generation server it could pick, and nothing would be left to retry on)
    wait_until(lambda: all_servers_healthy(pair.url), 30, what="the router seeing every server healthy")
    lost = generation_on("node_c")
    cluster.nodes.remove_node(cluster.node_c)
    wait_until(lambda: alive([lost["pid"]]) == [], 60, what="the lost node's server process gone with its actor")
    assert [b["choices"][0]["text"] for b in texts(pair.url)] == reference  # on the generation server left
    wait_until(lambda: f"{lost['name']} is not healthy" in launch_log(pair.path, "pair"), 10,
               what="the launcher reporting the lost server")
    assert pair.proc.poll() is None  # the deployment still serves: the launcher goes on


def test_sigint_leaves_no_server_process_and_no_actor(pair):
    pids = server_pids(pair.path)
    assert len(pids) == 3, pids  # context-0, the generation server of node B, the router
    pair.proc.send_signal(signal.SIGINT)
    assert pair.proc.wait(timeout=120) == 0, launch_log(pair.path, "pair")
    assert "stopped router (exit code 0)" in launch_log(pair.path, "pair")  # drained: SIGTERM, exit 0
    assert actors("pair") == []
    assert alive(pids) == [] and server_pids(pair.path) == []


def test_tp2_context_server_on_one_node_detached_then_ray_down(cluster, tmp_path, reference):
    path, cfg = write_config(tmp_path, pinned("node_b", "node_a", tensor_parallel_size=2))
    proc = start_launch(cluster, path, "tp", "--detach")
    assert proc.wait(timeout=READY_S) == 0, launch_log(path, "tp")
    url = f"http://127.0.0.1:{cfg['port']}"
    assert httpx.get(f"{url}/health").status_code == 200
    assert actors("tp") == ["tp/context-0", "tp/context-0/rank1", "tp/generation-0", "tp/router"]
    ctx = info("tp/context-0")
    import ray

    rank1 = ray.get(ray.get_actor("tp/context-0/rank1").info.remote(), timeout=60)
    assert ctx["node_id"] == rank1["node_id"] == node_ids()["node_b"]  # STRICT_PACK: both ranks on node B
    replay(url, reference)
    endpoints = httpx.get(f"{ctx['health_url'].removesuffix('/health')}/kv_cache/endpoint",
                          headers={"x-pdserve-token": psutil.Process(ctx["pid"]).environ()["PDSERVE_AUTH_TOKEN"]})
    assert len(endpoints.json()["endpoints"]) == 2
    pids = [p for name in ("context-0", "generation-0", "router") for p in process_tree(info(f"tp/{name}")["pid"])]
    assert len(pids) >= 4  # the context server's rank 1 is a child of its rank 0
    down = pdserve("ray", "down", "tp", "--address", cluster.address)
    assert down.returncode == 0, down.stdout + down.stderr
    assert actors("tp") == []
    wait_until(lambda: alive(pids) == [], 10, what="every process of tp gone")


def test_resources_no_node_has_fail_the_launch_at_once(cluster, tmp_path):
    path, _ = write_config(tmp_path, pinned("node_x", "node_b"))
    start = time.monotonic()
    out = pdserve("launch", str(path), "--ray", cluster.address, "--name", "nowhere", timeout_s=60)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "context_servers.ray_actor_options: context-0 needs {CPU: 1, node_x: 1} on one node" in out.stderr
    assert "no node of the cluster has that" in out.stderr
    assert time.monotonic() - start < 60 and actors("nowhere") == []


def test_without_ray_the_launch_says_how_to_install(tmp_path):
    shadow = tmp_path / "shadow" / "ray"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('No module named ray (hidden by the test)')\n")
    path, _ = write_config(tmp_path, pinned("node_a", "node_b"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "shadow"), str(ROOT)])}
    for argv in (["launch", str(path), "--ray", "auto"], ["ray", "status", "any"]):
        out = subprocess.run([sys.executable, "-m", "server.cli", *argv], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 2, out.stdout + out.stderr
        assert "pip install 'pdserve[ray]'" in out.stderr
