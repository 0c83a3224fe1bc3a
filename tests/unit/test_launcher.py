"""server/deploy/launcher.py without processes: child plan, commands, environment."""

import os
import sys
from pathlib import Path

import yaml

from server.config.schema import (
    AUTH_TOKEN_ENV,
    HOSTNAME_ENV,
    RestartPolicy,
    load_deployment,
    load_server,
    with_auth_token,
)
from server.deploy.launcher import Child, child_env, pdserve_command, plan_children
from server.deploy.supervisor import Supervisor

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TOKEN = "f" * 64


def test_plan_points_every_child_at_the_deployment_file_and_its_own_server(monkeypatch, no_env_overrides):
    cfg = with_auth_token(load_deployment(CONFIGS / "disagg_2x2.yaml"), TOKEN)
    servers, router = plan_children(cfg, CONFIGS / "disagg_2x2.yaml")
    assert [(c.name, c.role, c.health_url) for c in servers] == [
        ("context-0", "context", "http://127.0.0.1:8001/health"),
        ("context-1", "context", "http://127.0.0.1:8002/health"),
        ("generation-0", "generation", "http://127.0.0.1:8003/health"),
        ("generation-1", "generation", "http://127.0.0.1:8004/health"),
    ]
    assert router == Child("router", "router", (CONFIGS / "disagg_2x2.yaml").resolve(),
                           "http://127.0.0.1:8000/health")
    monkeypatch.setenv(AUTH_TOKEN_ENV, TOKEN)  # as the launcher hands it to the children
    for child, server in zip(servers, cfg.servers, strict=True):
        assert child.config_path == (CONFIGS / "disagg_2x2.yaml").resolve()
        assert load_server(child.config_path, child.name) == server


def test_plan_without_router_probes_wildcard_on_loopback(monkeypatch):
    monkeypatch.setenv(HOSTNAME_ENV, "0.0.0.0")
    cfg = load_deployment(CONFIGS / "aggregated.yaml")
    servers, router = plan_children(cfg, CONFIGS / "aggregated.yaml")
    assert router is None
    assert [(c.name, c.role, c.health_url) for c in servers] == [
        ("aggregated-0", "aggregated", "http://127.0.0.1:8000/health")]
    assert load_server(servers[0].config_path, "aggregated-0").host == "0.0.0.0"  # the child's environment


def test_pdserve_commands():
    server = Child("context-0", "context", Path("/cfg/d.yaml"), "http://127.0.0.1:8001/health")
    router = Child("router", "router", Path("/cfg/d.yaml"), "http://127.0.0.1:8000/health")
    assert pdserve_command(server) == [sys.executable, "-m", "server.cli", "serve", "--config",
                                       "/cfg/d.yaml", "--server", "context-0"]
    assert pdserve_command(router) == [sys.executable, "-m", "server.cli", "router", "--config",
                                       "/cfg/d.yaml"]


def test_children_share_the_cores(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    env = child_env({"PATH": "/bin"}, "tok", num_servers=2)
    assert env["OMP_NUM_THREADS"] == "2" and "GOMP_SPINCOUNT" not in env
    assert env[AUTH_TOKEN_ENV] == "tok" and env["PATH"] == "/bin"
    assert child_env({}, "tok", num_servers=1)["OMP_NUM_THREADS"] == "4"
    chosen = child_env({"OMP_NUM_THREADS": "3"}, "tok", num_servers=2)
    assert chosen["OMP_NUM_THREADS"] == "3"  # the user's choice stands


def test_each_server_gets_its_sections_env(tmp_path, no_env_overrides):
    """`env` per section (which GPUs a server sees, ...): a real child process reads it."""
    path = tmp_path / "d.yaml"
    path.write_text(yaml.safe_dump({
        "model": "builtin:tiny-llama", "env": {"PDSERVE_TEST_ALL": "top"},
        "context_servers": {"urls": ["127.0.0.1:8001"], "env": {"CUDA_VISIBLE_DEVICES": "0,1"}},
        "generation_servers": {"urls": ["127.0.0.1:8002"], "env": {"OMP_NUM_THREADS": 3}}}))
    servers, _ = plan_children(load_deployment(path), path)
    assert [c.env for c in servers] == [{"CUDA_VISIBLE_DEVICES": "0,1"}, {"OMP_NUM_THREADS": "3"}]
    script = "import os, sys; print(os.environ.get('CUDA_VISIBLE_DEVICES'), os.environ['PATH'] != '')"
    group = Supervisor(lambda child: [sys.executable, "-c", script], {"PATH": os.environ["PATH"]}, tmp_path,
                       RestartPolicy(), 0.1, lambda _: None)
    run = group.start(servers[0])
    assert run.popen.wait(timeout=30) == 0
    assert run.log_path.read_text().split() == ["0,1", "True"]
