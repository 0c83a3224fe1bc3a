"""The CUDA MPS control daemon of one `pdserve launch`, for the servers that share a GPU (`gpu_share`).

`start_gpu_share` starts `nvidia-cuda-mps-control -d` with pipe and log directories private to the
launch (`<log dir>/mps/`, 0700); `GpuShare.env_of(name)` is what a sharing server adds to its
environment (kept in its Child, so a restart gets the same) and `stop()` quits the daemon after the
servers. Every command has a timeout. Where MPS cannot run, the servers time-slice the GPU and one
line says why (nothing on a CPU deployment); CUDA_MPS_PIPE_DIRECTORY set for the launcher means MPS
is run by hand."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from server.deploy.gpu_share import VISIBLE_DEVICES, GpuSharePlan

CONTROL = "nvidia-cuda-mps-control"
SMI = "nvidia-smi"
PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
LOG_ENV = "CUDA_MPS_LOG_DIRECTORY"
PERCENT_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
COMMAND_TIMEOUT_S = 10.0  # each run of nvidia-smi or nvidia-cuda-mps-control
READY_TIMEOUT_S = 10.0  # the daemon answering after `-d`; gone after `quit`
PID_FILE = "nvidia-cuda-mps-control.pid"  # the daemon's, in its pipe directory while it runs
PING = "get_default_active_thread_percentage"  # a command any running daemon answers
MAX_PIPE_DIR_CHARS = 80  # the daemon's sockets live in it, and a socket's path fits in 107 bytes
EXCLUSIVE_PROCESS = "Exclusive_Process"  # nvidia-smi's name of the compute mode

Say = Callable[[str], None]


@dataclass(frozen=True)
class Gpu:
    """One row of `nvidia-smi --query-gpu=index,uuid,compute_mode`."""

    index: str
    uuid: str
    compute_mode: str


class MpsDaemon:
    """One control daemon whose pipe and log directories are `root/pipe` and `root/log`."""

    def __init__(self, exe: str, root: Path, env: Mapping[str, str], timeout_s: float = COMMAND_TIMEOUT_S,
                 ready_s: float = READY_TIMEOUT_S) -> None:
        self.exe, self.root, self.timeout_s, self.ready_s = exe, root, timeout_s, ready_s
        self.pipe_dir, self.log_dir = root / "pipe", root / "log"
        self.pid_file = self.pipe_dir / PID_FILE
        # without CUDA_VISIBLE_DEVICES: the daemon numbers the GPUs as the host does, so a server's
        # own CUDA_VISIBLE_DEVICES means under MPS what it means without
        base = {k: v for k, v in env.items() if k != VISIBLE_DEVICES}
        self.env = {**base, **self.client_env()}

    def client_env(self) -> dict[str, str]:
        return {PIPE_ENV: str(self.pipe_dir), LOG_ENV: str(self.log_dir)}

    def start(self) -> str | None:
        """None once the daemon runs and answers; else why not (then none is left running)."""
        out = self.root / "start.out"  # not a pipe: the daemon's process may hold it open
        try:
            for path in (self.root, self.pipe_dir, self.log_dir):
                private_dir(path)
        except OSError as exc:
            return f"cannot make the private directory {exc.filename}: {exc.strerror or exc}"
        try:
            with open(out, "wb") as sink:
                done = subprocess.run([self.exe, "-d"], stdin=subprocess.DEVNULL, stdout=sink, stderr=sink,
                                      env=self.env, timeout=self.timeout_s, start_new_session=True)
        except (OSError, subprocess.TimeoutExpired) as exc:
            if isinstance(exc, subprocess.TimeoutExpired):
                self.stop()  # it may have started before it stopped answering
            return self._failure(f"{CONTROL} -d", exc)
        if done.returncode != 0:
            return f"`{CONTROL} -d` failed with exit code {done.returncode}{_last_line(out.read_bytes())}"
        problem = self._wait_answer()
        if problem is not None:
            self.stop()
        return problem

    def stop(self) -> str | None:
        """Quit the daemon and wait until it has exited; None, or what went wrong."""
        done = self.command("quit")
        if isinstance(done, str):
            return done
        if done.returncode != 0:
            return f"`echo quit | {CONTROL}` failed with exit code {done.returncode}{_last_line(done.stdout)}"
        deadline = time.monotonic() + self.ready_s
        while self.pid_file.exists():  # the daemon removes it as it exits (its sockets' files stay)
            if time.monotonic() > deadline:
                return (f"the CUDA MPS daemon of {self.pipe_dir} did not quit within {self.ready_s:g} s (its pid: "
                        f"{self.pid_file.read_text().strip() if self.pid_file.exists() else 'gone'})")
            time.sleep(0.1)
        return None

    def command(self, line: str) -> subprocess.CompletedProcess[bytes] | str:
        """`echo LINE | nvidia-cuda-mps-control` for this daemon: its result, or why it did not run."""
        try:
            return subprocess.run([self.exe], input=f"{line}\n".encode(), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, env=self.env, timeout=self.timeout_s)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return self._failure(f"echo {line} | {CONTROL}", exc)

    def _wait_answer(self) -> str | None:
        deadline = time.monotonic() + self.ready_s
        while True:
            done = self.command(PING)
            if not isinstance(done, str) and done.returncode == 0:
                return None
            if time.monotonic() > deadline:
                why = done if isinstance(done, str) else f"exit code {done.returncode}{_last_line(done.stdout)}"
                return f"the CUDA MPS daemon started but did not answer within {self.ready_s:g} s ({why})"
            time.sleep(0.1)

    def _failure(self, what: str, exc: BaseException) -> str:
        if isinstance(exc, subprocess.TimeoutExpired):
            return f"`{what}` did not finish within {self.timeout_s:g} s"
        return f"`{what}` could not run: {getattr(exc, 'strerror', None) or exc}"


@dataclass
class GpuShare:
    """The environment of each server under MPS, and the daemon to stop (None: no MPS)."""

    plan: GpuSharePlan = field(default_factory=GpuSharePlan)
    daemon: MpsDaemon | None = None
    say: Say = print
    pair_on_gpu: bool = False  # a context and a generation server share a GPU, under MPS or time-sliced

    def env_of(self, name: str) -> dict[str, str]:
        percent = self.plan.percent_of(name)
        if self.daemon is None or percent is None:
            return {}
        return {**self.daemon.client_env(), PERCENT_ENV: str(percent)}

    def stop(self) -> None:
        if self.daemon is not None:
            problem, self.daemon = self.daemon.stop(), None
            if problem is not None:
                self.say(f"gpu_share: {problem}")


def start_gpu_share(plan: GpuSharePlan, log_dir: Path, env: Mapping[str, str], say: Say) -> GpuShare:
    """Run the plan's groups under a daemon of this launch where the host allows it."""
    if not plan.groups:
        return GpuShare()
    gpus = list_gpus(env)
    if not gpus:  # a CPU host: quiet, unless a server asked for CUDA
        if any(g.cuda_required for g in plan.groups):
            say(_time_sliced(plan, "no CUDA device (nvidia-smi lists none)"))
        return GpuShare()
    pair = any(g.pair for g in plan.groups)
    if env.get(PIPE_ENV):
        say(f"gpu_share: {PIPE_ENV}={env[PIPE_ENV]} is set for the launcher, so CUDA MPS is run by hand: the "
            "servers keep their environment and no daemon is started (gpu_share: off says so quietly)")
        return GpuShare(pair_on_gpu=pair)
    exe = shutil.which(CONTROL, path=env.get("PATH", os.defpath))
    daemon = MpsDaemon(exe or CONTROL, log_dir / "mps", env)
    reason = host_problem(plan, gpus, exe, daemon.pipe_dir) or daemon.start()
    if reason is not None:
        say(_time_sliced(plan, reason))
        return GpuShare(pair_on_gpu=pair)
    say(f"gpu_share: {plan.describe()} under CUDA MPS (its daemon: {PIPE_ENV}={daemon.pipe_dir} {CONTROL})")
    return GpuShare(plan, daemon, say, pair)


def host_problem(plan: GpuSharePlan, gpus: list[Gpu], exe: str | None, pipe_dir: Path) -> str | None:
    """Why this host cannot run the plan's groups under a daemon of ours; None: it can."""
    busy = exclusive_gpu(plan, gpus)
    if busy is not None:
        return (f"GPU {busy} is in exclusive-process compute mode (one CUDA process, or an administrator's "
                "MPS, owns it)")
    if exe is None:
        return f"no {CONTROL} on PATH"
    other = foreign_daemon(mps_processes(), os.getuid())
    if other is not None:
        return other
    if len(str(pipe_dir)) > MAX_PIPE_DIR_CHARS:
        return (f"the MPS pipe directory {pipe_dir} is longer than {MAX_PIPE_DIR_CHARS} characters (its sockets' "
                "paths would not fit): give the launch a shorter --log-dir")
    return None


def list_gpus(env: Mapping[str, str]) -> list[Gpu]:
    """The host's GPUs as nvidia-smi lists them; [] when it is missing, fails or lists none."""
    exe = shutil.which(SMI, path=env.get("PATH", os.defpath))
    if exe is None:
        return []
    try:
        done = subprocess.run([exe, "--query-gpu=index,uuid,compute_mode", "--format=csv,noheader"],
                              stdin=subprocess.DEVNULL, capture_output=True, text=True, env=dict(env),
                              timeout=COMMAND_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return []
    rows = [[part.strip() for part in line.split(",")] for line in done.stdout.splitlines()]
    return [Gpu(*row) for row in rows if len(row) == 3] if done.returncode == 0 else []


def exclusive_gpu(plan: GpuSharePlan, gpus: list[Gpu]) -> str | None:
    """The first GPU of the plan (as its servers name it: index or UUID) in exclusive-process mode."""
    for group in plan.groups:
        for name in group.gpus:
            for gpu in gpus:
                named = name == gpu.index or (name.startswith("GPU-") and gpu.uuid.startswith(name))
                if named and gpu.compute_mode == EXCLUSIVE_PROCESS:
                    return name
    return None


def mps_processes() -> list[tuple[int, int]]:
    """(pid, real uid) of each MPS control daemon and server running on this host."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if not (entry / "comm").read_text().startswith("nvidia-cuda-mps"):  # comm: 15 characters
                continue
            status = (entry / "status").read_text().splitlines()
            uid = next(int(line.split()[1]) for line in status if line.startswith("Uid:"))
        except (OSError, StopIteration, ValueError, IndexError):  # gone meanwhile, or not ours to read
            continue
        found.append((int(entry.name), uid))
    return sorted(found)


def foreign_daemon(processes: list[tuple[int, int]], uid: int) -> str | None:
    """Why another user's MPS processes keep ours off the host; None if there are none."""
    other = next(((pid, owner) for pid, owner in processes if owner != uid), None)
    if other is None:
        return None
    return (f"another user's CUDA MPS daemon runs on this host (pid {other[0]}, uid {other[1]}); the launcher "
            "leaves MPS to it")


def private_dir(path: Path) -> None:
    """`path` as a directory only its owner may enter (made 0700, or narrowed to it)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)


def _time_sliced(plan: GpuSharePlan, reason: str) -> str:
    return f"gpu_share: {plan.describe()}: no CUDA MPS, the servers time-slice the GPU: {reason}"


def _last_line(output: bytes | None) -> str:
    lines = (output or b"").decode(errors="replace").strip().splitlines()
    return f": {lines[-1].strip()}" if lines else ""
