"""The container images, built and run by Docker: where `docker info` answers, `Dockerfile` is built,
run, and must become healthy (its own HEALTHCHECK) and answer a completion through the router on a
published port, as a non-root user; `Dockerfile.cuda` is built and must promise the same launch.
Without a usable Docker engine these tests skip and say so (the development machine and CI have
the Docker client at most; docs/DEPLOY.md, "What was built where").

One static check runs everywhere, because it can fail on its own: the build context
(.dockerignore) keeps every source the images install and drops local state.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import uuid
from pathlib import Path

import httpx
import pytest
import yaml
from waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
BUILD_TIMEOUT_S = 1800  # pulls a base image and installs torch
HEALTHY_TIMEOUT_S = 300  # the Dockerfile's HEALTHCHECK start period
LAUNCH = ["pdserve", "launch", "configs/disagg.yaml"]


@functools.cache
def docker_problem() -> str | None:
    """Why Docker cannot build here, or None."""
    if shutil.which("docker") is None:
        return "no docker client on PATH"
    try:
        done = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return "`docker info` did not answer within 30 s"
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        return f"`docker info` failed: {lines[-1] if lines else done.returncode}"
    return None


needs_docker = pytest.mark.skipif(docker_problem() is not None,
                                  reason=f"Docker is not usable here ({docker_problem()}); the images are "
                                         "built and run only where a Docker engine answers")


def docker(*args: str, timeout_s: float = 120) -> str:
    done = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, f"docker {' '.join(args)} failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return done.stdout.strip()


@pytest.fixture(scope="module")
def image_of():
    """Builds a Dockerfile of the repository into a throwaway tag; every tag is removed afterwards."""
    tags: list[str] = []

    def build(dockerfile: str) -> str:
        tag = f"pdserve-test-{uuid.uuid4().hex[:12]}"
        docker("build", "-f", str(REPO / dockerfile), "-t", tag, str(REPO), timeout_s=BUILD_TIMEOUT_S)
        tags.append(tag)
        return tag

    yield build
    for tag in tags:
        subprocess.run(["docker", "image", "rm", "-f", tag], capture_output=True, timeout=120)


def image_config(tag: str) -> dict:
    return json.loads(docker("image", "inspect", "--format", "{{json .Config}}", tag))


def assert_launch_promises(config: dict) -> None:
    """What both images promise: the default deployment, as a non-root user, on all interfaces."""
    assert config["Cmd"] == LAUNCH
    assert config["User"] not in ("", "root", "0", "0:0")
    router_port = yaml.safe_load((REPO / "configs" / "disagg.yaml").read_text())["port"]
    assert f"{router_port}/tcp" in config["ExposedPorts"]
    assert "PDSERVE_HOSTNAME=0.0.0.0" in config["Env"]
    assert config["Healthcheck"]["Test"][0] == "CMD"


@needs_docker
def test_cpu_image_serves_a_completion_and_reports_healthy(image_of):
    tag = image_of("Dockerfile")
    config = image_config(tag)
    assert_launch_promises(config)
    container = docker("run", "-d", "-p", "127.0.0.1::8000", tag)
    try:
        wait_until(lambda: docker("inspect", "--format", "{{.State.Health.Status}}", container), HEALTHY_TIMEOUT_S,
                   "the container's own health check", interval_s=2.0, check=lambda status: status == "healthy",
                   on_timeout=lambda: docker("logs", "--tail", "50", container))
        user = docker("exec", container, "id", "-un")
        assert user == config["User"] != "root"
        address = docker("port", container, "8000/tcp").splitlines()[0]
        body = {"model": "builtin:tiny-story", "prompt": "The", "max_tokens": 8, "temperature": 0}
        response = httpx.post(f"http://{address}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] >= 1
    finally:
        subprocess.run(["docker", "rm", "-f", container], capture_output=True, timeout=120)


@needs_docker
@pytest.mark.skipif(os.environ.get("PDSERVE_TEST_CUDA_IMAGE") != "1",
                    reason="the CUDA image pulls a multi-GB base image; set PDSERVE_TEST_CUDA_IMAGE=1 to build it")
def test_cuda_image_builds_with_the_same_launch(image_of):
    cuda = image_config(image_of("Dockerfile.cuda"))
    assert_launch_promises(cuda)
    cpu = image_config(image_of("Dockerfile"))
    for key in ("Cmd", "User", "ExposedPorts", "Healthcheck"):
        assert cuda[key] == cpu[key], key


def test_build_context_keeps_the_sources_and_drops_local_state():
    ignored = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".git", ".venv", "**/__pycache__"} <= ignored
    needed = {"server", "kvcache", "transceiver", "pdserve_bench", "configs", "scripts", "pyproject.toml", "README.md"}
    assert not ignored & needed
    assert all((REPO / name).exists() for name in needed)
