"""The CUDA MPS control daemon around a benchmark phase (scripts/bench_gpu_load.py --disagg-variants mps).

Without MPS, two processes on one GPU are time-sliced: a decode step of the generation server waits
while the context server's prefill holds the GPU. Under MPS their kernels run at once on disjoint
shares of the SMs; `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` in a server's `env:` caps its share. Every
CUDA process started while the daemon runs (with the same pipe directory) becomes its client.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

KNOWN_PATHS = ("/usr/local/nvidia/bin/nvidia-cuda-mps-control", "/usr/bin/nvidia-cuda-mps-control")
TIMEOUT_S = 30.0


def control_binary() -> str:
    found = shutil.which("nvidia-cuda-mps-control") or next((p for p in KNOWN_PATHS if Path(p).exists()), None)
    if found is None:
        raise FileNotFoundError("nvidia-cuda-mps-control not found (MPS needs the NVIDIA driver's tools)")
    return found


@contextmanager
def mps_daemon(workdir: Path) -> Iterator[dict[str, str]]:
    """Start the daemon; yield the environment its clients need; quit it (and wait) on exit."""
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(workdir / "mps-pipe"), "CUDA_MPS_LOG_DIRECTORY": str(workdir / "mps-log")}
    for path in env.values():
        Path(path).mkdir(parents=True, exist_ok=True)
    exe = control_binary()
    full = {**os.environ, **env}
    subprocess.run([exe, "-d"], env=full, check=True, timeout=TIMEOUT_S)
    try:
        yield env
    finally:
        subprocess.run([exe], input=b"quit\n", env=full, timeout=TIMEOUT_S, check=False)
        _wait_gone(Path(env["CUDA_MPS_PIPE_DIRECTORY"]) / "control")


def _wait_gone(control_pipe: Path) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while control_pipe.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
