"""`gpu_share: auto` on one GPU: `pdserve launch` of the shipped pair starts the CUDA MPS daemon, the
servers and their engine processes run as its clients without an SM cap, the pair's greedy text
equals the pair's without MPS, and the daemon quits with the deployment. Skipped without CUDA or
without nvidia-cuda-mps-control on PATH.

The tiny model runs in float32. The bf16 case uses a model of an 8B model's width (2 layers, vocab of
128k), whose GEMMs take the large cuBLAS kernels: with the context server capped at 60% of the SMs
(CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=60), an H100 computed NaN logits for it (2026-12-07; -9999
logprobs on every token, no text), which the tiny float32 model did not show."""

from __future__ import annotations

import os
import shutil
import subprocess

import deploy_harness
import httpx
import psutil
import pytest
import torch

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(shutil.which("nvidia-cuda-mps-control") is None, reason="needs nvidia-cuda-mps-control"),
]

PROMPTS = ["The quick brown fox", "abc " * 200]


def _mps_env(pid: int) -> dict[str, str]:
    return {k: v for k, v in psutil.Process(pid).environ().items() if k.startswith("CUDA_MPS_")}


def _processes(dep: deploy_harness.Deployment, name: str) -> list[int]:
    """The server `name`'s process and its descendants (its engine process)."""
    [server] = deploy_harness.server_children(dep, name)
    return [server.pid, *(c.pid for c in server.children(recursive=True))]


def _ask(pipe: str, line: str) -> list[str]:
    done = subprocess.run(["nvidia-cuda-mps-control"], input=f"{line}\n".encode(), capture_output=True,
                          env={**os.environ, "CUDA_MPS_PIPE_DIRECTORY": pipe}, timeout=10)
    assert done.returncode == 0, done
    return done.stdout.decode().split()


def test_auto_runs_the_pair_under_the_launchers_mps_daemon(tmp_path) -> None:
    for name in ("plain", "mps"):
        (tmp_path / name).mkdir()
    with deploy_harness.launched("disagg.yaml", tmp_path / "plain", {"gpu_share": "off", "dtype": "float32"}) as plain:
        want = deploy_harness.greedy_texts(plain.url, PROMPTS, 16)
        assert [_mps_env(pid) for pid in _processes(plain, "context-0")] == [{}] * len(_processes(plain, "context-0"))
    with deploy_harness.launched("disagg.yaml", tmp_path / "mps", {"gpu_share": "auto", "dtype": "float32"}) as pair:
        got = deploy_harness.greedy_texts(pair.url, PROMPTS, 16)
        pipe, log = str(pair.log_dir / "mps" / "pipe"), str(pair.log_dir / "mps" / "log")
        clients = []
        for name, percent in (("context-0", "100"), ("generation-0", "100")):
            pids = _processes(pair, name)
            assert len(pids) >= 2, f"{name}: no engine process"  # engine_process: auto on CUDA
            for pid in pids:
                assert _mps_env(pid) == {"CUDA_MPS_PIPE_DIRECTORY": pipe, "CUDA_MPS_LOG_DIRECTORY": log,
                                         "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": percent}, name
            clients.append(pids)
        [server] = _ask(pipe, "get_server_list")  # the daemon started one MPS server for our clients
        print("MPS server", server, "clients", _ask(pipe, f"get_client_list {server}"), "our processes", clients)
        assert len(_ask(pipe, f"get_client_list {server}")) >= 2  # both engines
    launcher_log = (pair.log_dir / "launcher.log").read_text()
    said = [line for line in launcher_log.splitlines() if "gpu_share" in line]
    assert len(said) == 1 and "gpu_share: context-0 (100%) and generation-0 (100%) on GPU " in said[0], launcher_log
    assert " under CUDA MPS (its daemon: " in said[0], said
    # the daemon quit with the deployment (it removes its pid file as it exits)
    assert not (pair.log_dir / "mps" / "pipe" / "nvidia-cuda-mps-control.pid").exists()
    assert got == want


def _first_logprobs(url: str, prompt: str) -> list[dict[str, float]]:
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "logprobs": 3}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["logprobs"]["top_logprobs"]


def test_auto_in_bf16_on_an_8b_wide_model_equals_the_plain_pair(tmp_path) -> None:
    from pdserve_bench.gpu_handoff import build_model

    model = str(build_model(tmp_path / "wide", 2, text_tokens=512))
    overrides = {"model": model, "dtype": "bfloat16", "max_seq_len": 2048, "kv_cache_config": {"max_tokens": 32768}}
    texts, logprobs = {}, {}
    for share in ("off", "auto"):
        (tmp_path / share).mkdir()
        with deploy_harness.launched("disagg.yaml", tmp_path / share, {**overrides, "gpu_share": share}) as dep:
            texts[share] = deploy_harness.greedy_texts(dep.url, PROMPTS, 16)
            logprobs[share] = _first_logprobs(dep.url, PROMPTS[0])
    for share, rows in logprobs.items():  # a broken forward's logits are NaN: every logprob -9999
        assert all(-50 < value < 0 for row in rows for value in row.values()), (share, rows)
    assert texts["auto"] == texts["off"]
