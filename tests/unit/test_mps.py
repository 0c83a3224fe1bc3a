"""server/deploy/mps.py against stand-in NVIDIA tools (tests/fake_nvidia.py: real executables first on
PATH that record their calls): the daemon's start and stop commands, and every reason to do without."""

import os
import stat
import subprocess
import time
from pathlib import Path

import fake_nvidia
import pytest

from server.deploy.gpu_share import GpuSharePlan, SharedGpus
from server.deploy.mps import (
    LOG_ENV,
    PERCENT_ENV,
    PIPE_ENV,
    Gpu,
    MpsDaemon,
    foreign_daemon,
    list_gpus,
    mps_processes,
    start_gpu_share,
)

PAIR = GpuSharePlan((SharedGpus(("0",), {"context-0": 60, "generation-0": 100}, False, True),))
FALLBACK = "gpu_share: context-0 (60%) and generation-0 (100%) on GPU 0: no CUDA MPS, the servers time-slice the GPU: "


@pytest.fixture
def tools(short_tmp) -> fake_nvidia.FakeTools:
    return fake_nvidia.install(short_tmp / "bin")


def start(short_tmp: Path, tools: fake_nvidia.FakeTools, plan: GpuSharePlan = PAIR, **env):
    """start_gpu_share with the fake tools first on PATH: (GpuShare, lines said, log dir)."""
    said, log_dir = [], short_tmp / "logs"
    log_dir.mkdir(exist_ok=True)
    share = start_gpu_share(plan, log_dir, {"PATH": tools.path(), **env}, said.append)
    return share, said, log_dir


def test_the_daemon_starts_with_private_dirs_and_quits(short_tmp, tools):
    share, said, log_dir = start(short_tmp, tools, CUDA_VISIBLE_DEVICES="0")
    pipe, log = log_dir / "mps" / "pipe", log_dir / "mps" / "log"
    assert said == [f"gpu_share: context-0 (60%) and generation-0 (100%) on GPU 0 under CUDA MPS "
                    f"(its daemon: {PIPE_ENV}={pipe} nvidia-cuda-mps-control)"]
    seen = f"pipe={pipe} log={log} visible=unset"  # the daemon numbers GPUs as the host does
    assert tools.calls() == [f"-d {seen}", f"get_default_active_thread_percentage {seen}"]
    for path in (log_dir / "mps", pipe, log):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700
    assert share.env_of("context-0") == {PIPE_ENV: str(pipe), LOG_ENV: str(log), PERCENT_ENV: "60"}
    assert share.env_of("generation-0") == {PIPE_ENV: str(pipe), LOG_ENV: str(log), PERCENT_ENV: "100"}
    assert share.env_of("router") == {} and share.pair_on_gpu  # the launcher tells its router so
    assert (pipe / "nvidia-cuda-mps-control.pid").exists()
    share.stop()
    assert tools.calls()[2:] == [f"quit {seen}"]
    assert not (pipe / "nvidia-cuda-mps-control.pid").exists() and said[1:] == []
    share.stop()  # once only
    assert len(tools.calls()) == 3


def test_a_daemon_that_fails_to_start_is_reported_and_nothing_changes(short_tmp, tools):
    tools.set_mode("fail-start")
    share, said, _ = start(short_tmp, tools)
    assert said == [FALLBACK + "`nvidia-cuda-mps-control -d` failed with exit code 1: An instance of this "
                               "daemon is already running"]
    assert [c.split()[0] for c in tools.calls()] == ["-d"]
    assert share.env_of("context-0") == {} and share.pair_on_gpu  # time-sliced, still one GPU
    share.stop()
    assert len(tools.calls()) == 1


def test_a_daemon_that_does_not_answer_is_quit_and_reported(short_tmp, tools):
    tools.set_mode("no-answer")
    daemon = MpsDaemon(str(tools.bin / "nvidia-cuda-mps-control"), short_tmp / "mps", {"PATH": tools.path()},
                       ready_s=0.5)
    reason = daemon.start()
    assert reason == ("the CUDA MPS daemon started but did not answer within 0.5 s (exit code 1: Cannot find MPS "
                      "control daemon process)")
    calls = [c.split()[0] for c in tools.calls()]
    assert calls[0] == "-d" and calls[-1] == "quit" and set(calls[1:-1]) == {"get_default_active_thread_percentage"}


def test_every_command_has_a_timeout(short_tmp, tools):
    tools.set_mode("hang")
    daemon = MpsDaemon(str(tools.bin / "nvidia-cuda-mps-control"), short_tmp / "mps", {"PATH": tools.path()},
                       timeout_s=0.5)
    began = time.monotonic()
    assert daemon.start() == "`nvidia-cuda-mps-control -d` did not finish within 0.5 s"
    assert daemon.stop() == "`echo quit | nvidia-cuda-mps-control` did not finish within 0.5 s"
    assert time.monotonic() - began < 10  # 0.5 s each
    assert [c.split()[0] for c in tools.calls()] == ["-d", "quit", "quit"]  # a -d that hangs is asked to quit


def test_a_daemon_that_will_not_quit_is_reported(short_tmp, tools):
    share, said, _ = start(short_tmp, tools)
    tools.set_mode("no-answer")
    share.stop()
    assert said[1:] == ["gpu_share: `echo quit | nvidia-cuda-mps-control` failed with exit code 1: Cannot find MPS "
                        "control daemon process"]


def test_a_daemon_that_stays_after_quit_is_reported_with_its_pid(short_tmp, tools):
    daemon = MpsDaemon(str(tools.bin / "nvidia-cuda-mps-control"), short_tmp / "mps", {"PATH": tools.path()},
                       ready_s=0.3)
    assert daemon.start() is None
    tools.set_mode("stay")
    assert daemon.stop() == f"the CUDA MPS daemon of {short_tmp}/mps/pipe did not quit within 0.3 s (its pid: 4242)"


def test_no_control_tool_on_path(short_tmp):
    tools = fake_nvidia.install(short_tmp / "bin", control=False)
    share, said, _ = start(short_tmp, tools, PATH=str(tools.bin))
    assert said == [FALLBACK + "no nvidia-cuda-mps-control on PATH"] and share.env_of("context-0") == {}


def test_a_gpu_in_exclusive_process_mode(short_tmp):
    uuid = "GPU-4f1c7d2e-0000-1111-2222-333344445555"
    tools = fake_nvidia.install(short_tmp / "bin", gpus=["0, GPU-aaaa, Default", f"1, {uuid}, Exclusive_Process"])
    plan = GpuSharePlan((SharedGpus(("GPU-4f1c",), {"context-0": 60, "generation-0": 100}, False),))
    share, said, _ = start(short_tmp, tools, plan)
    assert said == ["gpu_share: context-0 (60%) and generation-0 (100%) on GPU GPU-4f1c: no CUDA MPS, the servers "
                    "time-slice the GPU: GPU GPU-4f1c is in exclusive-process compute mode (one CUDA process, or "
                    "an administrator's MPS, owns it)"]
    assert tools.calls() == [] and share.env_of("context-0") == {}
    share, said, _ = start(short_tmp, tools)  # GPU 0 is in Default mode
    daemon = f"{PIPE_ENV}={short_tmp}/logs/mps/pipe nvidia-cuda-mps-control"
    assert said[0].endswith(f"under CUDA MPS (its daemon: {daemon})")
    share.stop()


def test_no_gpu_is_quiet_unless_a_server_asked_for_cuda(short_tmp):
    for tools in (fake_nvidia.install(short_tmp / "none", smi=False),
                  fake_nvidia.install(short_tmp / "empty", gpus=[])):
        share, said, _ = start(short_tmp, tools, PATH=str(tools.bin))
        assert said == [] and tools.calls() == [] and share.env_of("context-0") == {} and not share.pair_on_gpu
        cuda = GpuSharePlan((SharedGpus(("0",), {"context-0": 60, "generation-0": 100}, True, True),))
        share, said, _ = start(short_tmp, tools, cuda, PATH=str(tools.bin))
        assert said == [FALLBACK + "no CUDA device (nvidia-smi lists none)"] and tools.calls() == []
        assert not share.pair_on_gpu


def test_an_empty_plan_runs_nothing(short_tmp, tools):
    share, said, log_dir = start(short_tmp, tools, GpuSharePlan())
    assert said == [] and tools.calls() == [] and not (log_dir / "mps").exists() and not share.pair_on_gpu
    share.stop()


def test_mps_run_by_hand_is_left_alone(short_tmp, tools):
    share, said, _ = start(short_tmp, tools, CUDA_MPS_PIPE_DIRECTORY="/tmp/mps-pipe")
    assert said == ["gpu_share: CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe is set for the launcher, so CUDA MPS is run "
                    "by hand: the servers keep their environment and no daemon is started (gpu_share: off says "
                    "so quietly)"]
    assert tools.calls() == [] and share.env_of("context-0") == {}


def test_a_pipe_dir_too_long_for_sockets(short_tmp, tools):
    said, deep = [], short_tmp / ("d" * 90)
    deep.mkdir()
    share = start_gpu_share(PAIR, deep, {"PATH": tools.path()}, said.append)
    assert said == [FALLBACK + f"the MPS pipe directory {deep}/mps/pipe is longer than 80 characters (its sockets' "
                               "paths would not fit): give the launch a shorter --log-dir"]
    assert tools.calls() == [] and share.env_of("context-0") == {}


def test_another_users_daemon():
    assert foreign_daemon([(41, 1000), (42, 1000)], 1000) is None
    assert foreign_daemon([(41, 1000), (42, 0)], 1000) == (
        "another user's CUDA MPS daemon runs on this host (pid 42, uid 0); the launcher leaves MPS to it")


def test_mps_processes_are_found_with_their_owner(tools):
    daemon = subprocess.Popen([str(tools.bin / "nvidia-cuda-mps-control"), "-f"])
    try:
        deadline = time.monotonic() + 10
        while (daemon.pid, os.getuid()) not in mps_processes() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (daemon.pid, os.getuid()) in mps_processes()
    finally:
        daemon.kill()
        daemon.wait(timeout=10)
    assert daemon.pid not in [pid for pid, _ in mps_processes()]


def test_gpus_as_nvidia_smi_lists_them(short_tmp):
    tools = fake_nvidia.install(short_tmp / "bin", gpus=["0, GPU-aaaa, Default", "1, GPU-bbbb, Exclusive_Process"])
    assert list_gpus({"PATH": str(tools.bin)}) == [Gpu("0", "GPU-aaaa", "Default"),
                                                   Gpu("1", "GPU-bbbb", "Exclusive_Process")]
    assert list_gpus({"PATH": str(short_tmp)}) == []
