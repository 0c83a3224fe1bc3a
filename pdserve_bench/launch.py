"""Start the server under test for a benchmark and stop it cleanly afterwards.

A deployment YAML (configs/aggregated.yaml or configs/disagg.yaml) is copied into a temporary
folder with free loopback ports and the requested `enable_block_reuse`, then run as
`python -m server.cli serve --config X` (no server lists: aggregated) or `... launch X`
(context/generation servers behind the router; with `launcher=True` an aggregated one too, so that
`pdserve launch` supervises and restarts it). The child gets its own process group; stopping
sends SIGINT to the child (the launcher forwards it), then SIGTERM and SIGKILL to that group.
With `profile=PATH`, py-spy samples the server and all its children from health until stop and
writes collapsed stacks to PATH (summarize them with `pdserve-bench profile`).
"""

from __future__ import annotations

import copy
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

from pdserve_bench.cpu import PROC, descendants, process_table
from server.deploy.ports import quiet_ports
from server.deploy.supervisor import health

REPO = Path(__file__).resolve().parents[1]
HEALTH_TIMEOUT_S = 300.0
STOP_GRACE_S = 20.0
_SERVER_LISTS = ("context_servers", "generation_servers")
LAUNCHER_READY = "[pdserve launch] ready: "  # server/deploy/launcher.py prints it, then supervises


def wait_for_health(base_url: str, timeout_s: float, alive: Callable[[], bool] = lambda: True,
                    interval_s: float = 0.25) -> bool:
    """Poll `base_url`/health until 200 (True), or `alive()` turns False or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and alive():
        if health(f"{base_url}/health", 2.0)[0] == 200:
            return True
        time.sleep(interval_s)
    return False


def free_ports(count: int) -> list[int]:
    """`count` distinct loopback ports, free now and outside the kernel's ephemeral range."""
    return quiet_ports(count)


def is_disaggregated(deployment: dict[str, Any]) -> bool:
    return any(key in deployment for key in _SERVER_LISTS)


def _set_reuse(section: dict[str, Any], reuse: bool) -> None:
    if "kv_cache_config" in section:
        section["kv_cache_config"]["enable_block_reuse"] = reuse


def merged(base: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """`base` with `extra` merged in, mapping by mapping (a copy; neither is changed)."""
    out = copy.deepcopy(dict(base))
    for key, value in extra.items():
        both = isinstance(value, Mapping) and isinstance(out.get(key), Mapping)
        out[key] = merged(out[key], value) if both else copy.deepcopy(value)
    return out


def server_urls(deployment: Mapping[str, Any], section: str) -> list[str]:
    """Base URLs of a started deployment's `context_servers` or `generation_servers`."""
    return [f"http://{url}" for url in deployment.get(section, {}).get("urls", [])]


def bench_deployment(base: dict[str, Any], reuse: bool) -> dict[str, Any]:
    """`base` on fresh loopback ports with block reuse on or off everywhere (top level and sections)."""
    out = copy.deepcopy(base)
    out["hostname"] = "127.0.0.1"
    out.setdefault("kv_cache_config", {})
    _set_reuse(out, reuse)
    lists = [key for key in _SERVER_LISTS if key in out]
    ports = free_ports(1 + sum(out[key]["num_instances"] for key in lists))
    out["port"] = ports.pop()
    for key in lists:
        out[key]["urls"] = [f"127.0.0.1:{ports.pop()}" for _ in range(out[key]["num_instances"])]
        _set_reuse(out[key], reuse)
    return out


class ServerUnderTest:
    """`with ServerUnderTest(Path("configs/aggregated.yaml"), reuse=True) as url:` -> base URL.

    `overrides` are merged into the YAML (e.g. a model, pool sizes); `deployment` is then the
    configuration that was started (its servers: `server_urls`); `startup_s` the seconds from the
    start to a healthy deployment."""

    def __init__(self, config: Path, *, reuse: bool = True, profile: Path | None = None,
                 env: Mapping[str, str] | None = None, health_timeout_s: float = HEALTH_TIMEOUT_S,
                 overrides: Mapping[str, Any] | None = None, launcher: bool = False):
        self.config = config
        self.reuse = reuse
        self.launcher = launcher
        self.startup_s = float("nan")
        self.overrides = overrides or {}
        self.deployment: dict[str, Any] = {}
        self.env = {**os.environ, **(env or {})}  # e.g. OMP_NUM_THREADS for the servers only
        self.profile = profile
        self.health_timeout_s = health_timeout_s
        self.workdir = Path(tempfile.mkdtemp(prefix="pdserve-bench-"))
        self.proc: subprocess.Popen[bytes] | None = None
        self.profiler: subprocess.Popen[bytes] | None = None
        self.url = ""

    @property
    def pid(self) -> int | None:
        """The child's pid, which is also its process group id (it leads a new session)."""
        return self.proc.pid if self.proc is not None else None

    @property
    def log_path(self) -> Path:
        return self.workdir / "server.log"

    def __enter__(self) -> str:
        base = merged(yaml.safe_load(self.config.read_text()), self.overrides)
        deployment = self.deployment = bench_deployment(base, self.reuse)
        path = self.workdir / self.config.name
        path.write_text(yaml.safe_dump(deployment, sort_keys=False))
        launched = self.launcher or is_disaggregated(deployment)
        verb = ["launch", str(path), "--log-dir", str(self.workdir / "logs")] if launched else \
            ["serve", "--config", str(path)]
        self.url = f"http://127.0.0.1:{deployment['port']}"
        started = time.perf_counter()
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "server.cli", *verb], cwd=REPO,
                                         env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        try:
            self._wait_healthy()
            self.startup_s = time.perf_counter() - started
            if self.profile is not None:
                self.profiler = start_py_spy(self.proc.pid, self.profile)
        except BaseException:
            self.stop()
            raise
        return self.url

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _wait_healthy(self) -> None:
        alive = lambda: self.proc is None or self.proc.poll() is None
        deadline = time.monotonic() + self.health_timeout_s
        if wait_for_health(self.url, self.health_timeout_s, alive) and self._launcher_ready(deadline, alive):
            return
        if not alive():
            raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
        raise TimeoutError(f"{self.url}/health not 200 after {self.health_timeout_s} s:\n{self.log_tail()}")

    def _launcher_ready(self, deadline: float, alive) -> bool:
        """A launcher prints its ready line after its own checks, and supervises only from then on
        (a server that dies before is a failed launch, not a restart); `serve` has no such line."""
        if "launch" not in self.proc.args:
            return True
        while alive() and time.monotonic() < deadline:
            if LAUNCHER_READY in self.log_path.read_text(errors="replace"):
                return True
            time.sleep(0.1)
        return False

    def stop(self) -> None:
        """SIGINT, then SIGTERM, then SIGKILL to the child's process group; each step waits."""
        stop_py_spy(self.profiler)
        self.profiler = None
        proc, self.proc = self.proc, None
        if proc is None:
            return
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
            if proc.poll() is not None:
                break
            _signal_group(proc.pid, sig, whole_group=sig != signal.SIGINT)
            try:
                proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                continue
        _signal_group(proc.pid, signal.SIGKILL, whole_group=True)  # leftovers of the group, if any

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def server_pid(root_pid: int, server: str) -> int:
    """The pid of `pdserve serve ... --server SERVER` among the live descendants of `root_pid` (a
    launcher started by `ServerUnderTest`); LookupError when there is none (e.g. it is restarting)."""
    table = process_table()
    for pid in descendants(table, root_pid):
        try:
            argv = (PROC / str(pid) / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"serve" in argv and b"--server" in argv and server.encode() in argv:
            return pid
    raise LookupError(f"no live server {server!r} under process {root_pid}")


def _signal_group(pid: int, sig: signal.Signals, *, whole_group: bool) -> None:
    """Signal the child (`pid`) or its whole process group (the child leads it: pgid == pid)."""
    try:
        if whole_group:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except ProcessLookupError:
        pass


def start_py_spy(pid: int, out: Path) -> subprocess.Popen[bytes]:
    """py-spy (on PATH, or $PY_SPY) recording `pid` and its children as collapsed stacks into `out`."""
    exe = os.environ.get("PY_SPY") or shutil.which("py-spy")
    if exe is None:
        raise FileNotFoundError("py-spy not found: pip install py-spy, or set PY_SPY to its path")
    argv = [exe, "record", "--pid", str(pid), "--subprocesses", "--nonblocking", "--rate", "250",
            "--format", "raw", "--output", str(out)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # let it attach before the measurement starts
    return proc


def stop_py_spy(proc: subprocess.Popen[bytes] | None) -> None:
    """SIGINT makes py-spy write its output; kill it if it does not finish in time."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=STOP_GRACE_S)
