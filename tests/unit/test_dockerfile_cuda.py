"""Dockerfile.cuda (no Docker engine here): parsed like the CPU Dockerfile, it must promise the same
launch with a CUDA torch: an NVIDIA CUDA runtime base, the install script CI uses without the CPU
wheel index, a non-root user, the default deployment on all interfaces."""

import json

from test_launcher_dockerfile import REPO, index_of, instructions

from server.config import HOSTNAME_ENV

CUDA = "Dockerfile.cuda"


def test_cuda_base_image_and_python():
    items = instructions(CUDA)
    word, image = items[0]
    assert word == "FROM" and image.startswith("nvidia/cuda:") and "-runtime-" in image
    apt = items[index_of(items, "RUN", "apt-get install")][1]
    assert "python3-venv" in apt.split() and "rm -rf /var/lib/apt/lists" in apt


def test_installs_with_the_ci_script_and_a_cuda_torch():
    items = instructions(CUDA)
    install = index_of(items, "RUN", "scripts/install.sh")
    assert items[install][1] == "PYTHON=python3 bash scripts/install.sh /opt/venv"
    assert index_of(items, "COPY", ". /app") < install
    extra = items[index_of(items, "ARG", "PIP_EXTRA_INDEX_URL")][1]
    assert "/whl/cpu" not in extra  # PyPI's Linux torch wheel is the CUDA build
    torch_arg = items[index_of(items, "ARG", "TORCH_VERSION=")][1]
    cpu_arg = instructions()[index_of(instructions(), "ARG", "TORCH_VERSION=")][1]
    assert torch_arg == cpu_arg  # one torch version for both images


def test_same_launch_as_the_cpu_image():
    cuda, cpu = instructions(CUDA), instructions()
    for word in ("CMD", "EXPOSE", "HEALTHCHECK", "ENV", "USER"):
        assert cuda[index_of(cuda, word)] == cpu[index_of(cpu, word)], word
    assert json.loads(cuda[index_of(cuda, "CMD")][1]) == ["pdserve", "launch", "configs/disagg.yaml"]
    assert f"{HOSTNAME_ENV}=0.0.0.0" in cuda[index_of(cuda, "ENV")][1].split()
    user = cuda[index_of(cuda, "USER")][1]
    assert user in cuda[index_of(cuda, "RUN", "useradd")][1].split()
    assert index_of(cuda, "RUN", "scripts/install.sh") < index_of(cuda, "USER")


def test_documented_in_deploy_md():
    doc = (REPO / "docs" / "DEPLOY.md").read_text()
    assert "docker build -f Dockerfile.cuda" in doc and "What was built where" in doc
