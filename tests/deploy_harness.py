"""Launches a real deployment (`pdserve launch`) on free loopback ports and tears it down.

Imported by integration tests as `import deploy_harness`. Every server is a real process; the
harness only rewrites the ports of a shipped YAML and waits for the router's /health.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from server.deploy.launcher import wait_for_health

ROOT = Path(__file__).resolve().parents[1]
STARTUP_TIMEOUT_S = 180.0
# The shipped configs name the trained default model; the tests that launch them compare against
# transformers on the random tiny model, so they run that one unless `overrides` name a model.
TEST_MODELS = {"builtin:tiny-story": "builtin:tiny-llama"}


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A port free now and not handed out before by this process (the kernel may offer a port again
    as soon as its probe socket closes, and one config must not get the same port twice)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


@dataclass
class Deployment:
    url: str
    context_urls: list[str]
    generation_urls: list[str]
    process: subprocess.Popen
    log_dir: Path
    config: dict = field(default_factory=dict)

    def logs(self) -> str:
        parts = [f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}" for p in sorted(self.log_dir.glob("*.log"))]
        return "\n".join(parts)

    def metric(self, server_url: str, name: str, labels: str = "") -> float:
        """Sum of the samples of `name` (whose label text contains `labels`) on one server."""
        text = httpx.get(f"{server_url}/metrics", timeout=10).text
        pattern = re.compile(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", re.M)
        return sum(float(v) for lab, v in pattern.findall(text) if labels in (lab or ""))

    def server_pids(self, role: str) -> list[int]:
        """pids of the launcher's children serving `role` (context|generation|router)."""
        import psutil

        pids = []
        for child in psutil.Process(self.process.pid).children(recursive=True):
            cmd = " ".join(child.cmdline())
            if (role == "router" and " router " in cmd) or f"--server {role}-" in cmd:
                pids.append(child.pid)
        return pids


def write_config(source: Path, tmp_path: Path, overrides: dict | None = None) -> tuple[Path, dict]:
    """Copy a shipped YAML with every port replaced by a free one (and `overrides` merged in).

    The default model becomes its test model (TEST_MODELS) unless `overrides` set `model`."""
    cfg = yaml.safe_load(source.read_text())
    cfg["model"] = TEST_MODELS.get(cfg["model"], cfg["model"])
    cfg = _merge(cfg, overrides or {})
    cfg["port"] = free_port()
    for section in ("context_servers", "generation_servers"):
        if section in cfg:
            cfg[section]["urls"] = [f"127.0.0.1:{free_port()}" for _ in cfg[section]["urls"]]
    path = tmp_path / source.name
    path.write_text(yaml.safe_dump(cfg))
    return path, cfg


@contextmanager
def launched(config: str, tmp_path: Path, overrides: dict | None = None,
             env: dict[str, str] | None = None) -> Iterator[Deployment]:
    """`env` is added to every process's environment (e.g. tests/faults' fault injection)."""
    path, cfg = write_config(ROOT / "configs" / config, tmp_path, overrides)
    log_dir = tmp_path / "logs"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", **(env or {})}
    log_dir.mkdir(parents=True, exist_ok=True)
    with open(log_dir / "launcher.log", "ab") as out:  # what the launcher says (why it stopped a child)
        process = subprocess.Popen([sys.executable, "-m", "server.cli", "launch", str(path), "--log-dir",
                                    str(log_dir)], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    deployment = Deployment(
        url=f"http://127.0.0.1:{cfg['port']}",
        context_urls=[f"http://{u}" for u in cfg.get("context_servers", {}).get("urls", [])],
        generation_urls=[f"http://{u}" for u in cfg.get("generation_servers", {}).get("urls", [])],
        process=process, log_dir=log_dir, config=cfg)
    try:
        _wait_ready(deployment)
        yield deployment
    finally:
        _stop(process)


def _wait_ready(deployment: Deployment) -> None:
    alive = lambda: deployment.process.poll() is None
    if wait_for_health(deployment.url, STARTUP_TIMEOUT_S, alive, interval_s=0.3):
        return
    if not alive():
        raise AssertionError(f"launcher exited with {deployment.process.returncode}\n{deployment.logs()}")
    raise AssertionError(f"deployment not healthy within {STARTUP_TIMEOUT_S} s\n{deployment.logs()}")


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:  # the router, then the servers, drain first (server/deploy/drain.py)
            process.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)


def greedy_texts(url: str, prompts: list[str], max_tokens: int, timeout_s: float = 120) -> list[str]:
    """Each prompt's greedy completion text (ignore_eos) from `url`, one request at a time."""
    out = []
    for prompt in prompts:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=timeout_s)
        assert response.status_code == 200, response.text
        out.append(response.json()["choices"][0]["text"])
    return out
