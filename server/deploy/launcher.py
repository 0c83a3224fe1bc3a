"""`pdserve launch CONFIG.yaml`: start every server and the router as child processes and supervise.

Order: check every port is free (a busy one ends the launch with 1 before anything starts); make a
token if the file has none; start the CUDA MPS daemon of `gpu_share`; start the servers (each its own
session, PR_SET_PDEATHSIG on Linux), wait for their /health and KV handshakes; start the router;
supervise (server/deploy/supervisor.py) until a stop signal (0) or the front is given up (1).
The token reaches the children only through PDSERVE_AUTH_TOKEN, and `<log dir>/auth_token` (0600)
while the launch runs; both the file and a log dir the launcher made go at exit (the logs stay when
the launch failed). docs/DEPLOY.md and docs/RELIABILITY.md describe it for operators."""

from __future__ import annotations

import os
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from server.config.router import SHARED_GPU_ENV, SHARED_GPU_LOCAL_PREFILL
from server.config.schema import (
    AUTH_TOKEN_ENV,
    AUTH_TOKEN_FILE_ENV,
    DeploymentConfig,
    load_deployment,
    with_auth_token,
)
from server.deploy.gpu_share import VISIBLE_DEVICES, plan_gpu_share
from server.deploy.mps import GpuShare, start_gpu_share
from server.deploy.ports import PORT_HINT, busy_ports
from server.deploy.supervisor import Child, StopOnSignals, Supervisor, health

TOKEN_FILE = "auth_token"
HANDSHAKE_TIMEOUT_S = 30.0  # generation servers shaking hands with every context server at startup

def pdserve_command(child: Child) -> list[str]:
    """The argv that runs `child` (the pdserve CLI's `serve` and `router` subcommands)."""
    base = [sys.executable, "-m", "server.cli"]
    if child.role == "router":
        return [*base, "router", "--config", str(child.config_path)]
    return [*base, "serve", "--config", str(child.config_path), "--server", child.name]


@dataclass(frozen=True)
class LaunchOptions:
    log_dir: Path | None = None  # None: a fresh temporary directory
    startup_timeout_s: float = 300.0  # for the servers, and again for the router
    poll_interval_s: float = 0.5
    grace_s: float = 10.0  # after a child's drain timeout: SIGTERM -> SIGKILL
    command: Callable[[Child], list[str]] = field(default=pdserve_command)


def launch(path: str | Path, options: LaunchOptions | None = None) -> int:
    """Run the deployment in `path` until a stop signal (returns 0) or a failure (returns 1)."""
    options = options or LaunchOptions()
    cfg = load_deployment(path)
    busy = busy_ports(cfg)
    if busy:  # before anything starts: never a launch that reports ready against another deployment
        _say("cannot start, nothing was started: " + ("a port of this deployment is" if len(busy) == 1 else
             "ports of this deployment are") + " in use:\n  " + "\n  ".join(busy) + f"\n  {PORT_HINT}")
        return 1
    if cfg.auth_token is None and any(s.kv_cache_config.disk is not None for s in cfg.servers):
        _say("kv_cache_config.disk: this launch makes its own token, so the next launch will not reuse the "
             "disk tier's files (they are sealed with it); set cache_transceiver_config.auth_token or "
             "PDSERVE_AUTH_TOKEN to keep them")
    cfg = with_auth_token(cfg, cfg.auth_token or secrets.token_hex(32))
    log_dir = Path(options.log_dir or tempfile.mkdtemp(prefix="pdserve-launch-"))  # mkdtemp: mode 0700
    log_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    _say(f"logs in {log_dir}")
    with StopOnSignals() as stop:  # from here on, every way out but SIGKILL cleans up
        token_file = write_private(log_dir / TOKEN_FILE, cfg.auth_token or "")
        code = 1
        try:
            code = _supervised(cfg, Path(path), log_dir, token_file, options, stop)
            return code
        finally:
            clean_up(log_dir, token_file, made=options.log_dir is None, failed=code != 0)


def _supervised(cfg: DeploymentConfig, path: Path, log_dir: Path, token_file: Path, options: LaunchOptions,
                stop: StopOnSignals) -> int:
    servers, router = plan_children(cfg, path)
    env = child_env(dict(os.environ), cfg.auth_token or "", len(servers))
    group = Supervisor(options.command, env, log_dir, cfg.restart, options.poll_interval_s, _say)
    share = GpuShare()
    try:
        share = start_gpu_share(plan_gpu_share(cfg.named(), os.environ.get(VISIBLE_DEVICES)), log_dir,
                                os.environ, _say)
        servers = [replace(c, env={**c.env, **share.env_of(c.name)}) for c in servers]
        if router is not None and share.pair_on_gpu:
            router = replace(router, env={**router.env, SHARED_GPU_ENV: "1"})
            if cfg.router.conditional is None:
                _say(f"gpu_share: the router serves prompts of up to {SHARED_GPU_LOCAL_PREFILL} new tokens on the "
                     "generation server alone (router.conditional; `conditional: {}` sends every prompt to the "
                     "context server)")
        return _run(group, servers, router, cfg, stop, options, token_file)
    finally:
        # the router drains first (its requests need the servers), then every server at once
        server_wait = max((s.drain_timeout_s for s in cfg.servers), default=0.0) + options.grace_s
        stages = [(["router"], cfg.drain_timeout_s + options.grace_s)] if router else []
        try:
            group.stop_all([*stages, ([], server_wait)])
        finally:
            share.stop()  # after its clients


def clean_up(log_dir: Path, token_file: Path, made: bool, failed: bool) -> None:
    """Once every child has stopped: the token file goes, and the log dir this launch made unless it failed."""
    token_file.unlink(missing_ok=True)
    if made and not failed:
        shutil.rmtree(log_dir, ignore_errors=True)
    elif made:
        _say(f"logs kept in {log_dir}")


def write_private(path: Path, text: str) -> Path:
    """`path` holding `text`, readable by its owner only (created 0600, never wider)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # an older file of the same name keeps its mode otherwise
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    return path


def child_env(base: dict[str, str], auth_token: str, num_servers: int) -> dict[str, str]:
    """The children's environment: the token, and torch threads (the cores shared out, so engines do not
    fight) unless the user chose."""
    env = {**base, AUTH_TOKEN_ENV: auth_token, "PYTHONUNBUFFERED": "1"}
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, num_servers))))
    return env


def plan_children(cfg: DeploymentConfig, deployment_path: Path) -> tuple[list[Child], Child | None]:
    """One child per server and the router; each reads the deployment file itself."""
    path = deployment_path.resolve()
    servers = [Child(name, server.role, path, health_url(server.host, server.port), dict(server.env))
               for name, server in cfg.named().items()]
    router = Child("router", "router", path, health_url(cfg.host, cfg.port)) if cfg.has_router else None
    return servers, router


def _run(group: Supervisor, servers: list[Child], router: Child | None, cfg: DeploymentConfig,
         stop: StopOnSignals, options: LaunchOptions, token_file: Path) -> int:
    for child in servers:
        group.start(child)
    if not group.wait_healthy(stop, options.startup_timeout_s) or not handshakes_done(stop, servers, _say):
        return 0 if stop.signum is not None else 1
    for child in servers:
        _say(f"{child.name} listening on {child.health_url.removesuffix('/health')} (model {cfg.model}, "
             f"role {child.role})")
    if router:
        group.start(router)
        if not group.wait_healthy(stop, options.startup_timeout_s):
            return 0 if stop.signum is not None else 1
        _say(f"router listening on {cfg.url} (policy {cfg.router.type})")
    _say(ready_line(cfg, cfg.url))
    # the children's torch threads too: a by-hand server with every core's threads spins against its peers
    threads = group.env.get("OMP_NUM_THREADS")
    # and under CUDA MPS, its daemon and share of the SMs
    mps = "".join(f"{k}={v} " for k, v in servers[0].env.items() if k.startswith("CUDA_MPS_"))
    _say(f"to start one server again by hand: {AUTH_TOKEN_FILE_ENV}={token_file} "
         f"{f'OMP_NUM_THREADS={threads} ' if threads else ''}{mps}{pdserve_program()} serve "
         f"--config {servers[0].config_path} --server {servers[0].name}  (names: "
         f"{', '.join(c.name for c in servers)})")
    return group.supervise("router" if router else servers[0].name, stop)


def pdserve_program() -> str:
    """How to run `pdserve` as this launcher was run: the console script beside this Python (a venv's
    bin/, which need not be on PATH), else the module."""
    script = Path(sys.executable).parent / "pdserve"
    return str(script) if script.is_file() else f"{sys.executable} -m server.cli"


def handshakes_done(stop: StopOnSignals, servers: list[Child], say: Callable[[str], None]) -> bool:
    """Every generation server has shaken hands with every context server (the KV layouts agree):
    True; a pair that disagrees fails the launch, naming what differs, before any request."""
    pending = [c for c in servers if c.role == "generation"]
    deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
    while pending and stop.signum is None:
        still = []
        for child in pending:
            peers = health(child.health_url, 2.0)[1].get("context_servers")
            if not isinstance(peers, dict):  # a server that does not report its peers
                continue
            bad = {url: state for url, state in peers.items() if str(state).startswith("incompatible")}
            if bad:
                say(f"{child.name} cannot use its context servers: "
                     + "; ".join(f"{url}: {state}" for url, state in bad.items()))
                return False
            if any(state != "compatible" for state in peers.values()):
                still.append(child)
        pending = still
        if pending and time.monotonic() > deadline:
            say(f"warning: {', '.join(c.name for c in pending)} did not finish the KV handshake with every "
                 f"context server within {HANDSHAKE_TIMEOUT_S:g} s; going on")
            return True
        if pending:
            time.sleep(0.2)
    return stop.signum is None


def health_url(host: str, port: int, wildcard_ip: str = "127.0.0.1") -> str:
    """A wildcard bind answers on `wildcard_ip`: loopback here, its node's address on Ray."""
    probe = wildcard_ip if host in ("0.0.0.0", "::", "") else host
    return f"http://{f'[{probe}]' if ':' in probe else probe}:{port}/health"


def ready_line(cfg: DeploymentConfig, url: str) -> str:
    roles = [s.role for s in cfg.servers]
    counts = ", ".join(f"{roles.count(r)} {r}" for r in dict.fromkeys(roles))
    return f"ready: {url}  ({'router in front of ' if cfg.has_router else ''}{counts} server(s))"


def _say(message: str) -> None:
    print(f"[pdserve launch] {message}", flush=True)
