"""`pdserve launch CONFIG.yaml`: start every server and the router as child processes and supervise.

Life of a launch:
1. Load the deployment; make an auth token when the file has none (secrets.token_hex). The token
   reaches the children only through the PDSERVE_AUTH_TOKEN environment variable.
2. Write each server's own YAML (server_config_to_yaml) into the log dir; start the servers, each in
   its own session (process group) and, on Linux, with PR_SET_PDEATHSIG so that even a SIGKILLed
   launcher takes them down. Output goes to <log dir>/<name>.log.
3. Wait until every server answers GET /health with 200; then start the router and wait for it.
   A child that exits meanwhile, or the startup timeout, stops everything and returns 1.
4. Print the URL and supervise: a dead server is reported with its exit code (the router fences it
   by health checks); if the router (or the only server when there is no router) dies, or every
   child is gone, stop everything and return 1. SIGINT/SIGTERM/SIGHUP: stop everything, return 0.
Stopping: SIGTERM to each child's process group, wait `grace_s`, then SIGKILL what is left.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from server.config import (
    AUTH_TOKEN_ENV,
    DeploymentConfig,
    load_deployment,
    server_config_to_yaml,
    with_auth_token,
)

_PR_SET_PDEATHSIG = 1
_LOG_TAIL_LINES = 20
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass(frozen=True)
class Child:
    """One process the launcher runs; `config_path` is the YAML it reads."""

    name: str  # "context-0", "generation-1", "aggregated-0", "router"
    role: str  # context | generation | aggregated | router
    config_path: Path
    health_url: str  # GET answers 200 once the child serves


CommandBuilder = Callable[[Child], list[str]]


def pdserve_command(child: Child) -> list[str]:
    """The argv that runs `child` (the pdserve CLI's `serve` and `router` subcommands)."""
    base = [sys.executable, "-m", "server.cli"]
    if child.role == "router":
        return [*base, "router", "--config", str(child.config_path)]
    return [*base, "serve", "--config", str(child.config_path), "--role", child.role]


@dataclass(frozen=True)
class LaunchOptions:
    log_dir: Path | None = None  # None: a fresh temporary directory
    startup_timeout_s: float = 300.0  # for the servers, and again for the router
    poll_interval_s: float = 0.5
    grace_s: float = 10.0  # SIGTERM -> SIGKILL
    command: CommandBuilder = field(default=pdserve_command)


def launch(path: str | Path, options: LaunchOptions | None = None) -> int:
    """Run the deployment in `path` until a stop signal (returns 0) or a failure (returns 1)."""
    options = options or LaunchOptions()
    cfg = load_deployment(path)
    cfg = with_auth_token(cfg, cfg.auth_token or secrets.token_hex(32))
    log_dir = Path(options.log_dir or tempfile.mkdtemp(prefix="pdserve-launch-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    _say(f"logs and per-server configs in {log_dir}")
    servers, router = plan_children(cfg, Path(path), log_dir)
    env = child_env(dict(os.environ), cfg.auth_token or "", len(servers))
    group = _Group(options, env, log_dir)
    with _StopOnSignals() as stop:
        try:
            return _run(group, servers, router, cfg, stop)
        finally:
            group.stop_all()


BORROWER_SPINCOUNT = "10000"


def child_env(base: dict[str, str], auth_token: str, num_servers: int) -> dict[str, str]:
    """The children's environment: the token, and torch threads shared out unless the user chose.

    Engines with less than every core may borrow idle ones for a step (`borrow_idle_cores`); an
    OpenMP worker then spins ~0.5 ms after the step on the borrowed core instead of libgomp's
    default of about 15 ms, which would take that core from the engine it was borrowed from."""
    env = {**base, AUTH_TOKEN_ENV: auth_token, "PYTHONUNBUFFERED": "1"}
    threads = threads_per_server(num_servers)
    env.setdefault("OMP_NUM_THREADS", str(threads))
    if threads < (os.cpu_count() or 1):
        env.setdefault("GOMP_SPINCOUNT", BORROWER_SPINCOUNT)
    return env


def threads_per_server(num_servers: int) -> int:
    """CPU threads for each engine's torch ops: the cores shared out, so engines do not fight."""
    return max(1, (os.cpu_count() or 1) // max(1, num_servers))


def plan_children(cfg: DeploymentConfig, deployment_path: Path,
                  log_dir: Path) -> tuple[list[Child], Child | None]:
    """Write `<log_dir>/<name>.yaml` for every server; the router reads the deployment file itself."""
    servers, counts = [], {}
    for server in cfg.servers:
        index = counts[server.role] = counts.get(server.role, -1) + 1
        name = f"{server.role}-{index}"
        config_path = log_dir / f"{name}.yaml"
        config_path.write_text(server_config_to_yaml(server))
        servers.append(Child(name, server.role, config_path, _health_url(server.host, server.port)))
    router = None
    if cfg.has_router:
        router = Child("router", "router", deployment_path.resolve(), _health_url(cfg.host, cfg.port))
    return servers, router


def _run(group: _Group, servers: list[Child], router: Child | None, cfg: DeploymentConfig,
         stop: _StopOnSignals) -> int:
    for stage in (servers, [router] if router else []):
        for child in stage:
            group.start(child)
        if not group.wait_healthy(stop):
            return 0 if stop.signum is not None else 1
    roles = [s.role for s in cfg.servers]
    counts = ", ".join(f"{roles.count(r)} {r}" for r in dict.fromkeys(roles))
    _say(f"ready: {cfg.url}  ({'router in front of ' if router else ''}{counts} server(s))")
    return group.supervise("router" if router else servers[0].name, stop)


@dataclass
class _Running:
    child: Child
    popen: subprocess.Popen[bytes]
    log_path: Path
    reported: bool = False  # its exit has been reported


class _Group:
    """The running children: start, wait for health, supervise, stop."""

    def __init__(self, options: LaunchOptions, env: dict[str, str], log_dir: Path) -> None:
        self.options, self.env, self.log_dir = options, env, log_dir
        self.running: list[_Running] = []

    def start(self, child: Child) -> None:
        log_path = self.log_dir / f"{child.name}.log"
        argv = self.options.command(child)
        with open(log_path, "ab") as log:
            popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                     env=self.env, start_new_session=True, preexec_fn=_die_with_parent())
        self.running.append(_Running(child, popen, log_path))
        _say(f"started {child.name} (pid {popen.pid}): {' '.join(argv)}  > {log_path}")

    def wait_healthy(self, stop: _StopOnSignals) -> bool:
        """True once every started child answers /health; False on exit, timeout or stop signal."""
        deadline = time.monotonic() + self.options.startup_timeout_s
        waiting = [r for r in self.running if not _healthy(r.child.health_url, 0.0)]
        while waiting:
            if stop.signum is not None:
                _say(f"stop requested ({signal.Signals(stop.signum).name}) during startup")
                return False
            for r in waiting:
                if r.popen.poll() is not None:
                    _say(f"{r.child.name} exited during startup with {_exit_text(r.popen.returncode)}"
                         f"{_log_tail(r.log_path)}")
                    return False
            if time.monotonic() > deadline:
                names = ", ".join(r.child.name for r in waiting)
                _say(f"startup timeout ({self.options.startup_timeout_s:g} s): no healthy /health from "
                     f"{names}" + "".join(_log_tail(r.log_path) for r in waiting))
                return False
            time.sleep(self.options.poll_interval_s)
            waiting = [r for r in waiting if not _healthy(r.child.health_url, self.options.poll_interval_s)]
        return True

    def supervise(self, front: str, stop: _StopOnSignals) -> int:
        while stop.signum is None:
            for r in self.running:
                if not r.reported and r.popen.poll() is not None:
                    r.reported = True
                    code = _exit_text(r.popen.returncode)
                    _say(f"{r.child.name} exited with {code}{_log_tail(r.log_path)}")
                    if r.child.name == front or all(x.reported for x in self.running):
                        _say("the deployment cannot serve any more: stopping")
                        return 1
            time.sleep(self.options.poll_interval_s)
        _say(f"{signal.Signals(stop.signum).name}: stopping")
        return 0

    def stop_all(self) -> None:
        """SIGTERM every child's process group, wait up to grace_s, SIGKILL what is left, reap all."""
        for r in self.running:
            _signal_group(r.popen.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.options.grace_s
        for r in self.running:
            try:
                r.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _say(f"{r.child.name} ignored SIGTERM for {self.options.grace_s:g} s: SIGKILL")
        for r in self.running:  # the group may outlive its leader (grandchildren)
            _signal_group(r.popen.pid, signal.SIGKILL)
            try:
                r.popen.wait(timeout=self.options.grace_s)
            except subprocess.TimeoutExpired:
                _say(f"{r.child.name} (pid {r.popen.pid}) did not die on SIGKILL")
        self.running = []


class _StopOnSignals:
    """Records the first stop signal (SIGINT/SIGTERM/SIGHUP) while active; restores handlers after."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> _StopOnSignals:
        for sig in _STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, _frame: object) -> None:
        if self.signum is None:
            self.signum = signum


def _health_url(host: str, port: int) -> str:
    probe = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host  # a wildcard bind answers on loopback
    return f"http://{probe}:{port}/health"


_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never via a proxy


def _healthy(url: str, timeout_s: float) -> bool:
    try:
        with _NO_PROXY.open(url, timeout=max(timeout_s, 0.2)) as response:
            return response.status == 200
    except (OSError, ValueError):  # refused, reset, timeout, HTTP error status
        return False


def wait_for_health(base_url: str, timeout_s: float, alive: Callable[[], bool] = lambda: True,
                    interval_s: float = 0.25) -> bool:
    """Poll `base_url`/health until it answers 200 (True), or `alive()` turns False or `timeout_s`
    passes (False). Shared by the launcher's callers: tests and benchmarks that start servers."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and alive():
        if _healthy(f"{base_url}/health", 2.0):
            return True
        time.sleep(interval_s)
    return False


def _die_with_parent() -> Callable[[], None] | None:
    """A preexec_fn asking Linux to SIGTERM the child when the launcher dies (even by SIGKILL)."""
    if sys.platform != "linux":
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    parent = os.getpid()

    def preexec() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))
        if os.getppid() != parent:  # the launcher died before prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    """Signal a child's process group (its pid: each child leads its own session)."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):  # the whole group is gone already
        pass


def _exit_text(returncode: int) -> str:
    return f"signal {signal.Signals(-returncode).name}" if returncode < 0 else f"exit code {returncode}"


def _log_tail(log_path: Path) -> str:
    try:
        lines = log_path.read_text(errors="replace").splitlines()[-_LOG_TAIL_LINES:]
    except OSError:
        return ""
    return f"\n--- last lines of {log_path} ---\n" + "\n".join(lines) if lines else f" (empty log {log_path})"


def _say(message: str) -> None:
    print(f"[pdserve launch] {message}", flush=True)
