"""The Dockerfile (no Docker engine here): parse it and check what the image promises."""

import json
import re
import tomllib
from pathlib import Path

import yaml

from server.config import HOSTNAME_ENV

REPO = Path(__file__).resolve().parents[2]


def instructions(name: str = "Dockerfile") -> list[tuple[str, str]]:
    """[(INSTRUCTION, arguments)] of REPO/name with comments dropped and continuation lines joined."""
    out, pending = [], ""
    for line in (REPO / name).read_text().splitlines():
        if line.strip().startswith("#") or not line.strip():
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        word, _, rest = pending.strip().partition(" ")
        out.append((word.upper(), re.sub(r"\s+", " ", rest.strip())))
        pending = ""
    assert pending == ""
    return out


def index_of(items: list[tuple[str, str]], word: str, contains: str = "") -> int:
    found = [i for i, (w, args) in enumerate(items) if w == word and contains in args]
    assert found, f"no {word} containing {contains!r}"
    return found[-1]


def test_base_image_and_install_script_shared_with_ci():
    items = instructions()
    assert items[0] == ("FROM", "python:3.11-slim")
    install = index_of(items, "RUN", "scripts/install.sh")
    assert items[install][1] == "bash scripts/install.sh /opt/venv"
    assert "bash scripts/install.sh" in (REPO / ".ci" / "run").read_text()
    cpu_index = index_of(items, "ARG", "PIP_EXTRA_INDEX_URL=")
    assert items[cpu_index][1] == "PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu"
    assert cpu_index < install
    assert index_of(items, "COPY", ". /app") < install


def test_runs_as_a_non_root_user_after_installing():
    items = instructions()
    user = index_of(items, "USER")
    assert items[user][1] not in ("root", "0", "0:0")
    assert items[user][1] in items[index_of(items, "RUN", "useradd")][1].split()
    assert index_of(items, "RUN", "scripts/install.sh") < user < index_of(items, "CMD")


def test_serves_the_default_deployment_on_all_interfaces():
    items = instructions()
    cmd = json.loads(items[index_of(items, "CMD")][1])
    assert cmd == ["pdserve", "launch", "configs/disagg.yaml"]
    assert "pdserve" in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    router_port = yaml.safe_load((REPO / "configs" / "disagg.yaml").read_text())["port"]
    assert items[index_of(items, "EXPOSE")][1] == str(router_port)
    env = items[index_of(items, "ENV", HOSTNAME_ENV)][1].split()
    assert f"{HOSTNAME_ENV}=0.0.0.0" in env
    assert "PATH=/opt/venv/bin:$PATH" in env
    assert f":{router_port}/health" in items[index_of(items, "HEALTHCHECK")][1]


def test_dockerignore_keeps_sources_and_drops_local_state():
    ignored = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".git", ".venv", "**/__pycache__"} <= ignored
    needed = {"server", "kvcache", "transceiver", "configs", "scripts", "pyproject.toml", "README.md"}
    assert not ignored & needed
