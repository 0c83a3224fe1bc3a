"""The launcher's children while they run: start, health-wait, restart the dead, stop in order.

A dead child is started again with the same command, port and environment after a backoff that
doubles with each quick death in a row (`RestartPolicy`); the new process has a new KV epoch.
Giving up on the front (the router, or the only server) ends the launch with 1. Stop: the router
first (it drains), then every server; each group gets its drain timeout plus `grace_s` after
SIGTERM, then SIGKILL."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

from server.config.schema import RestartPolicy
from server.exit import exit_text

_PR_SET_PDEATHSIG = 1
_LOG_TAIL_LINES = 20
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
MAX_BACKOFF_S = 30.0
MPS_PERCENT_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"  # a server's share of the SMs under MPS (mps.py)


@dataclass(frozen=True)
class Child:
    """One process the launcher runs; `config_path` is the deployment YAML it reads."""

    name: str  # "context-0", "generation-1", "aggregated-0", "router"
    role: str  # context | generation | aggregated | router
    config_path: Path
    health_url: str  # GET answers 200 once the child serves
    env: dict[str, str] = field(default_factory=dict)  # the server section's `env`, over the launcher's


@dataclass
class Running:
    child: Child
    popen: subprocess.Popen[bytes]
    log_path: Path
    started: float  # monotonic
    quick_deaths: int = 0  # quick deaths in a row
    restart_at: float | None = None  # dead, to be started again then
    died_at: float | None = None  # dead, waiting to be back (healthy again)
    gave_up: bool = False

    def exited(self) -> str | None:
        """How its process ended; None while it runs."""
        code = self.popen.poll()
        return None if code is None else exit_text(code)


def wait_healthy(children: list[Child], exited: Callable[[Child], str | None], tail: Callable[[Child], str],
                 stop: StopOnSignals, timeout_s: float, poll_interval_s: float, say: Callable[[str], None]) -> bool:
    """True once every child answers /health, wherever it runs (`exited(child)`: how it ended, None
    while it runs; `tail(child)`: the last lines of its log); False on exit, timeout, stop signal, or a
    child that reports a problem no wait can cure (status `incompatible`: layout skew)."""
    deadline = time.monotonic() + timeout_s
    waiting = [c for c in children if health(c.health_url, 0.0)[0] != 200]
    while waiting:
        if stop.signum is not None:
            say(f"stop requested ({signal.Signals(stop.signum).name}) during startup")
            return False
        for c in waiting:
            if (how := exited(c)) is not None:
                say(f"{c.name} exited during startup with {how}{tail(c)}")
                return False
        if time.monotonic() > deadline:
            names = ", ".join(c.name for c in waiting)
            say(f"startup timeout ({timeout_s:g} s): no healthy /health from {names}"
                + "".join(tail(c) for c in waiting))
            return False
        time.sleep(poll_interval_s)
        still = []
        for c in waiting:
            status, body = health(c.health_url, poll_interval_s)
            if body.get("status") == "incompatible":
                say(f"{c.name} cannot serve with its peers: {body.get('detail')}")
                return False
            if status != 200:
                still.append(c)
        waiting = still
    return True


class Supervisor:
    def __init__(self, command: Callable[[Child], list[str]], env: dict[str, str], log_dir: Path,
                 policy: RestartPolicy, poll_interval_s: float, say: Callable[[str], None]) -> None:
        self.command, self.env, self.log_dir = command, env, log_dir
        self.policy, self.poll_interval_s, self.say = policy, poll_interval_s, say
        self.running: list[Running] = []

    # ---- start and wait ---------------------------------------------------------------------

    def start(self, child: Child) -> Running:
        log_path = self.log_dir / f"{child.name}.log"
        argv = self.command(child)
        with open(log_path, "ab") as log:
            popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                     env={**self.env, **child.env}, start_new_session=True,
                                     preexec_fn=_die_with_parent())
        share = child.env.get(MPS_PERCENT_ENV)
        mps = f" under CUDA MPS ({share}% of the SMs)" if share else ""
        self.say(f"started {child.name} (pid {popen.pid}){mps}: {' '.join(argv)}  > {log_path}")
        run = Running(child, popen, log_path, time.monotonic())
        self.running.append(run)
        return run

    def wait_healthy(self, stop: StopOnSignals, timeout_s: float) -> bool:
        """`wait_healthy` for every started child."""
        runs = {r.child.name: r for r in self.running}
        return wait_healthy([r.child for r in self.running], lambda c: runs[c.name].exited(),
                            lambda c: log_tail(runs[c.name].log_path), stop, timeout_s, self.poll_interval_s, self.say)

    # ---- supervise ----------------------------------------------------------------------------

    def supervise(self, front: str, stop: StopOnSignals) -> int:
        """Restart dead children until a stop signal (0) or the deployment cannot serve (1)."""
        while stop.signum is None:
            now = time.monotonic()
            for r in list(self.running):
                if r.restart_at is None and not r.gave_up and r.popen.poll() is not None:
                    self._on_death(r, now)
                elif r.restart_at is not None and now >= r.restart_at:
                    self._restart(r)
                elif r.died_at is not None and health(r.child.health_url, 0.2)[0] == 200:
                    self.say(f"{r.child.name} is back: healthy {now - r.died_at:.1f} s after it died")
                    r.died_at = None
            given_up = [r for r in self.running if r.gave_up]
            if any(r.child.name == front for r in given_up) or len(given_up) == len(self.running):
                self.say("the deployment cannot serve any more: stopping")
                return 1
            time.sleep(self.poll_interval_s)
        self.say(f"{signal.Signals(stop.signum).name}: stopping")
        return 0

    def _on_death(self, r: Running, now: float) -> None:
        lived = now - r.started
        quick = lived < self.policy.quick_s
        r.quick_deaths = r.quick_deaths + 1 if quick else 0
        r.died_at = r.died_at or now
        self.say(f"{r.child.name} exited with {exit_text(r.popen.returncode)} after {lived:.1f} s"
                 f"{log_tail(r.log_path)}")
        if self.policy.max_quick_deaths == 0:
            r.gave_up = True
            self.say(f"{r.child.name} is not restarted (restart.max_quick_deaths is 0)")
            return
        if r.quick_deaths >= self.policy.max_quick_deaths:
            r.gave_up = True
            self.say(f"GIVING UP on {r.child.name}: it died {r.quick_deaths} times in a row within "
                     f"{self.policy.quick_s:g} s of starting (restart.max_quick_deaths); see {r.log_path}")
            return
        backoff = min(MAX_BACKOFF_S, self.policy.backoff_s * 2 ** max(0, r.quick_deaths - 1))
        r.restart_at = now + backoff
        self.say(f"restarting {r.child.name} in {backoff:g} s (quick deaths in a row: {r.quick_deaths})")

    def _restart(self, old: Running) -> None:
        self.running.remove(old)
        new = self.start(old.child)
        new.quick_deaths, new.died_at = old.quick_deaths, old.died_at

    # ---- stop ---------------------------------------------------------------------------------

    def stop_all(self, stages: list[tuple[list[str], float]]) -> None:
        """Stop children stage by stage: [(names, seconds to wait after SIGTERM)], then the rest;
        SIGKILL what outlives its wait, reap all."""
        named = {name for names, _ in stages for name in names}
        rest = [r.child.name for r in self.running if r.child.name not in named]
        for names, wait_s in [*stages, (rest, max((w for _, w in stages), default=10.0))]:
            self._stop_group([r for r in self.running if r.child.name in names], wait_s)
        self.running = []

    def _stop_group(self, group: list[Running], wait_s: float) -> None:
        for r in group:
            signal_group(r.popen.pid, signal.SIGTERM)
        deadline = time.monotonic() + wait_s
        for r in group:
            try:
                r.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.say(f"{r.child.name} ignored SIGTERM for {wait_s:g} s: SIGKILL")
        for r in group:  # the group may outlive its leader (grandchildren)
            signal_group(r.popen.pid, signal.SIGKILL)
            try:
                r.popen.wait(timeout=10.0)
            except subprocess.TimeoutExpired:
                self.say(f"{r.child.name} (pid {r.popen.pid}) did not die on SIGKILL")


class StopOnSignals:
    """Records the first stop signal (SIGINT/SIGTERM/SIGHUP) while active; restores handlers after."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopOnSignals:
        for sig in _STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, _frame: object) -> None:
        if self.signum is None:
            self.signum = signum


_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never via a proxy


def health(url: str, timeout_s: float) -> tuple[int, dict]:
    """(HTTP status, JSON body or {}) of GET `url`; status 0 when nothing answered."""
    try:
        with _NO_PROXY.open(url, timeout=max(timeout_s, 0.2)) as response:
            return response.status, _json(response.read())
    except urllib.error.HTTPError as exc:  # 503 & co: the body says why
        return exc.code, _json(exc.read())
    except (OSError, ValueError):  # refused, reset, timeout
        return 0, {}


def _json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


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


def signal_group(pgid: int, sig: signal.Signals) -> None:
    """Signal a child's process group (its pid: each child leads its own session)."""
    with suppress(ProcessLookupError, PermissionError):  # the whole group is gone already
        os.killpg(pgid, sig)


def log_tail(log_path: Path) -> str:
    try:
        lines = log_path.read_text(errors="replace").splitlines()[-_LOG_TAIL_LINES:]
    except OSError:
        return ""
    return f"\n--- last lines of {log_path} ---\n" + "\n".join(lines) if lines else f" (empty log {log_path})"
