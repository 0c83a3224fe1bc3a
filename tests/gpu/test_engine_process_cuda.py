"""The engine in its own process on a GPU (`engine_process: auto` is a child process on CUDA): the
server's HTTP process starts the engine process and never touches CUDA itself (only the child
shows among the GPU's compute processes), and the greedy answers equal those of the same server
with the engine on a thread (`engine_process: false`), aggregated and disaggregated. Skipped
without CUDA."""

from __future__ import annotations

import shutil
import subprocess

import deploy_harness
import psutil
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PROMPTS = ["The quick brown fox", "Topic: rivers. " + "filler words " * 40 + "Now answer briefly:", "abc " * 200]
CHILD = "server.engine_host.main"


def _texts(url: str) -> list[str]:
    return deploy_harness.greedy_texts(url, PROMPTS, 24, 120)


def _gpu_pids() -> set[int] | None:
    if shutil.which("nvidia-smi") is None:
        return None
    done = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                          capture_output=True, text=True, timeout=30)
    return {int(line) for line in done.stdout.split() if line.strip().isdigit()} if done.returncode == 0 else None


def _servers_and_engines(dep: deploy_harness.Deployment) -> list[tuple[psutil.Process, list[psutil.Process]]]:
    out = []
    for proc, argv in deploy_harness.live_children(dep.process.pid):
        if " serve " in " ".join(argv):
            out.append((proc, deploy_harness.children_running(proc.pid, CHILD)))
    return out


@pytest.mark.parametrize("config", ["aggregated.yaml", "disagg.yaml"])
def test_engine_processes_answer_as_engine_threads_do(tmp_path, config) -> None:
    for name in ("thread", "process"):
        (tmp_path / name).mkdir()
    with deploy_harness.launched(config, tmp_path / "thread", {"engine_process": False}) as dep:
        want = _texts(dep.url)
        assert all(engines == [] for _, engines in _servers_and_engines(dep))
    with deploy_harness.launched(config, tmp_path / "process") as dep:  # auto: a process on CUDA
        got = _texts(dep.url)
        servers = _servers_and_engines(dep)
        assert servers and all(len(engines) == 1 for _, engines in servers)
        on_gpu = _gpu_pids()
        if on_gpu is not None:  # nvidia-smi may not see pids inside a container's pid namespace
            assert not on_gpu & {server.pid for server, _ in servers}  # the HTTP processes hold no CUDA context
    assert got == want
