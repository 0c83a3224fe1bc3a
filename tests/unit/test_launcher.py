"""server/launcher.py without processes: child plan, per-server YAML, commands."""

import sys
from pathlib import Path

import yaml

from server.config import AUTH_TOKEN_ENV, HOSTNAME_ENV, load_deployment, load_server_config, with_auth_token
from server.launcher import BORROWER_SPINCOUNT, Child, child_env, pdserve_command, plan_children

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TOKEN = "f" * 64


def test_plan_writes_one_yaml_per_server(tmp_path, monkeypatch):
    monkeypatch.delenv(AUTH_TOKEN_ENV, raising=False)
    monkeypatch.delenv(HOSTNAME_ENV, raising=False)
    cfg = with_auth_token(load_deployment(CONFIGS / "disagg_2x2.yaml"), TOKEN)
    servers, router = plan_children(cfg, CONFIGS / "disagg_2x2.yaml", tmp_path)
    assert [(c.name, c.role, c.health_url) for c in servers] == [
        ("context-0", "context", "http://127.0.0.1:8001/health"),
        ("context-1", "context", "http://127.0.0.1:8002/health"),
        ("generation-0", "generation", "http://127.0.0.1:8003/health"),
        ("generation-1", "generation", "http://127.0.0.1:8004/health"),
    ]
    assert router == Child("router", "router", (CONFIGS / "disagg_2x2.yaml").resolve(),
                           "http://127.0.0.1:8000/health")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "context-0.yaml", "context-1.yaml", "generation-0.yaml", "generation-1.yaml"]
    for child, server in zip(servers, cfg.servers, strict=True):
        assert child.config_path == tmp_path / f"{child.name}.yaml"
        assert TOKEN not in child.config_path.read_text()
        monkeypatch.setenv(AUTH_TOKEN_ENV, TOKEN)  # as the launcher hands it to the child
        assert load_server_config(child.config_path, child.role) == server
        monkeypatch.delenv(AUTH_TOKEN_ENV)


def test_plan_without_router_probes_wildcard_on_loopback(tmp_path, monkeypatch):
    monkeypatch.setenv(HOSTNAME_ENV, "0.0.0.0")
    cfg = load_deployment(CONFIGS / "aggregated.yaml")
    servers, router = plan_children(cfg, CONFIGS / "aggregated.yaml", tmp_path)
    assert router is None
    assert [(c.name, c.role, c.health_url) for c in servers] == [
        ("aggregated-0", "aggregated", "http://127.0.0.1:8000/health")]
    assert yaml.safe_load(servers[0].config_path.read_text())["hostname"] == "0.0.0.0"


def test_pdserve_commands():
    server = Child("context-0", "context", Path("/logs/context-0.yaml"), "http://127.0.0.1:8001/health")
    router = Child("router", "router", Path("/cfg/d.yaml"), "http://127.0.0.1:8000/health")
    assert pdserve_command(server) == [sys.executable, "-m", "server.cli", "serve", "--config",
                                       "/logs/context-0.yaml", "--role", "context"]
    assert pdserve_command(router) == [sys.executable, "-m", "server.cli", "router", "--config",
                                       "/cfg/d.yaml"]


def test_children_share_the_cores_and_borrowers_spin_briefly(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    env = child_env({"PATH": "/bin"}, "tok", num_servers=2)
    assert env["OMP_NUM_THREADS"] == "2" and env["GOMP_SPINCOUNT"] == BORROWER_SPINCOUNT
    assert env[AUTH_TOKEN_ENV] == "tok" and env["PATH"] == "/bin"
    alone = child_env({}, "tok", num_servers=1)  # one engine has every core: nothing to borrow
    assert alone["OMP_NUM_THREADS"] == "4" and "GOMP_SPINCOUNT" not in alone
    chosen = child_env({"OMP_NUM_THREADS": "3", "GOMP_SPINCOUNT": "0"}, "tok", num_servers=2)
    assert (chosen["OMP_NUM_THREADS"], chosen["GOMP_SPINCOUNT"]) == ("3", "0")  # the user's choice stands
