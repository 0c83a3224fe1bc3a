"""`gpu_share` through the launcher, with real processes: stand-in servers (test_launcher_processes'
fake children) and stand-in NVIDIA tools (tests/fake_nvidia.py) first on PATH, then real `pdserve
launch`es of configs/disagg.yaml on the CPU."""

import re
import signal
from pathlib import Path

import deploy_harness
import fake_nvidia
import hf_reference
import pytest
import yaml
from test_launcher_processes import FAKE_CHILD, alive, child_pids, free_ports, run_inline, start_runner, wait_ready
from waiting import wait_until

from server.config.schema import AUTH_TOKEN_ENV, HOSTNAME_ENV
from server.deploy.launcher import pdserve_program
from server.models.builtin import resolve_model


@pytest.fixture
def shared(short_tmp, monkeypatch):
    """(the launch setup of test_launcher_processes: a pair and a router on one GPU, fake tools on PATH)."""
    monkeypatch.delenv(AUTH_TOKEN_ENV, raising=False)
    monkeypatch.delenv(HOSTNAME_ENV, raising=False)
    tools = fake_nvidia.install(short_tmp / "bin")
    monkeypatch.setenv("PATH", tools.path())
    ports = free_ports(3)
    deployment = short_tmp / "deploy.yaml"
    deployment.write_text(yaml.safe_dump({
        "model": "builtin:tiny-llama", "port": ports[0], "drain_timeout_s": 3, "gpu_share": "auto",
        "restart": {"max_quick_deaths": 3, "backoff_s": 0.1},
        "context_servers": {"urls": [f"127.0.0.1:{ports[1]}"]},
        "generation_servers": {"urls": [f"127.0.0.1:{ports[2]}"]},
    }))
    script = short_tmp / "fake_child.py"
    script.write_text(FAKE_CHILD)
    return (deployment, script, short_tmp / "logs", ports), tools


def mps_lines(log: Path) -> list[str]:
    return re.findall(r"^mps=(.*)$", log.read_text(), re.M)


def test_the_pair_runs_under_the_launchers_daemon_until_ctrl_c(shared):
    setup, tools = shared
    log_dir = setup[2]
    pipe, mps_log = log_dir / "mps" / "pipe", log_dir / "mps" / "log"
    proc, out = start_runner(setup, {})
    try:
        wait_ready(proc, out)
        assert mps_lines(log_dir / "context-0.log") == [f"{pipe} {mps_log} 100"]
        assert mps_lines(log_dir / "generation-0.log") == [f"{pipe} {mps_log} 100"]
        assert mps_lines(log_dir / "router.log") == ["- - -"]
        assert (pipe / "nvidia-cuda-mps-control.pid").exists()
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        assert proc.wait(timeout=20) == 0
    finally:
        proc.kill()
    text = out.read_text()
    assert text.count("gpu_share:") == 2
    assert ("gpu_share: the router serves prompts of up to 256 new tokens on the generation server alone "
            "(router.conditional; `conditional: {}` sends every prompt to the context server)") in text
    assert (f"gpu_share: context-0 (100%) and generation-0 (100%) on GPU 0 under CUDA MPS (its daemon: "
            f"CUDA_MPS_PIPE_DIRECTORY={pipe} nvidia-cuda-mps-control)") in text
    assert re.search(r"started context-0 \(pid \d+\) under CUDA MPS \(100% of the SMs\)", text)
    assert (f"CUDA_MPS_PIPE_DIRECTORY={pipe} CUDA_MPS_LOG_DIRECTORY={mps_log} CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100 "
            f"{pdserve_program()} serve --config") in text  # the command that starts context-0 again by hand
    assert [c.split()[0] for c in tools.calls()] == ["-d", "get_default_active_thread_percentage", "quit"]
    assert not (pipe / "nvidia-cuda-mps-control.pid").exists()
    assert [pid for pid in child_pids(log_dir).values() if alive(pid)] == []


def test_a_restarted_server_keeps_the_daemon_and_its_share(shared):
    setup, tools = shared
    proc, out = start_runner(setup, {"context-0": ["--exit-after", "1", "--code", "9", "--die-times", "1"]})
    try:
        wait_ready(proc, out)
        wait_until(lambda: "context-0 is back: healthy" in out.read_text(), 30, "the restart")
        pipe, mps_log = setup[2] / "mps" / "pipe", setup[2] / "mps" / "log"
        assert mps_lines(setup[2] / "context-0.log") == [f"{pipe} {mps_log} 100"] * 2
        started = r"started context-0 \(pid \d+\) under CUDA MPS \(100% of the SMs\)"
        assert len(re.findall(started, out.read_text())) == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        proc.kill()
    assert [c.split()[0] for c in tools.calls()] == ["-d", "get_default_active_thread_percentage", "quit"]


def test_a_failed_start_quits_the_daemon(shared, capsys):
    setup, tools = shared
    assert run_inline(setup, {"context-0": ["--exit-after", "0", "--code", "3"]}) == 1
    assert "context-0 exited during startup with exit code 3" in capsys.readouterr().out
    assert [c.split()[0] for c in tools.calls()] == ["-d", "get_default_active_thread_percentage", "quit"]
    assert not (setup[2] / "mps" / "pipe" / "nvidia-cuda-mps-control.pid").exists()


def test_without_the_daemon_the_pair_starts_plainly_and_one_line_says_why(shared, capsys):
    setup, tools = shared
    tools.set_mode("fail-start")
    assert run_inline(setup, {"router": ["--exit-after", "0.3", "--code", "0"]}) == 1
    said = [line for line in capsys.readouterr().out.splitlines() if "gpu_share" in line or "MPS" in line]
    assert said == ["[pdserve launch] gpu_share: context-0 (100%) and generation-0 (100%) on GPU 0: no CUDA MPS, the "
                    "servers time-slice the GPU: `nvidia-cuda-mps-control -d` failed with exit code 1: An instance of "
                    "this daemon is already running",
                    "[pdserve launch] gpu_share: the router serves prompts of up to 256 new tokens on the generation "
                    "server alone (router.conditional; `conditional: {}` sends every prompt to the context server)"]
    assert mps_lines(setup[2] / "context-0.log") == ["- - -"]
    assert [c.split()[0] for c in tools.calls()] == ["-d"]


# ---- real `pdserve launch` on the CPU ------------------------------------------------------------

def _server_environ(dep: deploy_harness.Deployment, name: str) -> dict[str, str]:
    [child] = deploy_harness.server_children(dep, name)
    return {k: v for k, v in child.environ().items() if k.startswith("CUDA_MPS_")}


@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_pdserve_launch_on_the_cpu(short_tmp, device):
    """device cpu: no MPS and not a word about it. device auto where nvidia-smi lists a GPU: the real
    servers get the daemon's variables (on a CPU they are only environment), and the router serves a
    short prompt on the generation server alone (a context leg on a shared GPU reads the weights again)."""
    tools = fake_nvidia.install(short_tmp / "bin")
    overrides = {"device": device, "gpu_share": "auto"}
    prompts = ["The quick brown fox", "word " * 300]  # 5 and 301 prompt tokens: under and over 256
    with deploy_harness.launched("disagg.yaml", short_tmp, overrides, env={"PATH": tools.path()}) as dep:
        texts = deploy_harness.greedy_texts(dep.url, prompts, 4)
        routed = {name: dep.metric(dep.url, f"pdserve_router_{name}_requests_total")
                  for name in ("local", "disaggregated")}
        environs = {name: _server_environ(dep, name) for name in ("context-0", "generation-0")}
    model = resolve_model(dep.config["model"])
    assert texts == [hf_reference.hf_text_ignore_eos(model, p, 4) for p in prompts]
    assert routed == ({"local": 0, "disaggregated": 2} if device == "cpu" else {"local": 1, "disaggregated": 1})
    launcher_log = (dep.log_dir / "launcher.log").read_text()
    local_line = "gpu_share: the router serves prompts of up to 256 new tokens on the generation server alone"
    assert (local_line in launcher_log) == (device == "auto")
    pipe, log = dep.log_dir / "mps" / "pipe", dep.log_dir / "mps" / "log"
    if device == "cpu":
        assert re.findall(r".*(?:gpu_share|MPS).*", launcher_log) == []
        assert tools.calls() == [] and not (dep.log_dir / "mps").exists()
        assert environs == {"context-0": {}, "generation-0": {}}
    else:
        mps = {"CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(log)}
        assert environs == {"context-0": {**mps, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100"},
                            "generation-0": {**mps, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100"}}
        assert [c.split()[0] for c in tools.calls()] == ["-d", "get_default_active_thread_percentage", "quit"]
