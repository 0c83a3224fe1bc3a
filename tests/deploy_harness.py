"""Launches a real deployment (`pdserve launch`), or one aggregated server (`pdserve serve
--config`), on free loopback ports and tears it down.

Imported by integration tests as `import deploy_harness`. Every server is a real process; the
harness only rewrites the ports of a shipped YAML (or writes a server's YAML) and waits for /health.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import psutil
import yaml
from waiting import wait_until

from pdserve_bench.launch import wait_for_health
from server.deploy.ports import quiet_ports

if TYPE_CHECKING:
    import openai

ROOT = Path(__file__).resolve().parents[1]
STARTUP_TIMEOUT_S = 180.0
# The shipped configs name the trained default model; the tests that launch them compare against
# transformers on the random tiny model, so they run that one unless `overrides` name a model.
TEST_MODELS = {"builtin:tiny-story": "builtin:tiny-llama"}
# The one server `served` starts, unless its settings say otherwise.
SERVER = {"model": "builtin:tiny-llama", "hostname": "127.0.0.1", "max_seq_len": 512, "max_batch_size": 8,
          "max_num_tokens": 256, "kv_cache_config": {"tokens_per_block": 16, "max_tokens": 4096}}
# The `openai` client's keywords for a greedy request that goes on past EOS (vLLM's ignore_eos).
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
# `topic_prompts`: a topic each, then one sentence repeated to make them long.
TOPICS = ["astronomy", "cooking", "gardening", "history", "music", "sailing"]
FILLER = "The system should keep the answer short, clear and correct, and it should cite the facts it uses. "


_HANDED_OUT: set[int] = set()


def _lane() -> tuple[int, int]:
    """This pytest-xdist worker's share of the port range (gw0 -> 0 of 8), inherited by the
    processes a test starts."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    digits = worker.removeprefix("gw")
    return (int(digits) if digits.isdigit() else 0), 8


def free_port() -> int:
    """A free port below the ephemeral range (no KV socket or client connection can take it before
    the server binds it), never handed out twice by this process."""
    lane, lanes = _lane()
    port = quiet_ports(1, lane, lanes, avoid=_HANDED_OUT)[0]
    _HANDED_OUT.add(port)
    return port


def free_ports(n: int) -> list[int]:
    return [free_port() for _ in range(n)]


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
        return metric(server_url, name, labels)

    def server_pids(self, role: str) -> list[int]:
        """pids of the launcher's children serving `role` (context|generation|router)."""
        pids = []
        for child, argv in live_children(self.process.pid):
            cmd = " ".join(argv)
            if (role == "router" and " router " in cmd) or f"--server {role}-" in cmd:
                pids.append(child.pid)
        return pids


def metric(url: str, name: str, labels: str = "") -> float:
    """Sum of the samples of `name` (whose label text contains `labels`) on the server at `url`."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    pattern = re.compile(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", re.M)
    return sum(float(v) for lab, v in pattern.findall(text) if labels in (lab or ""))


def openai_client(url: str, timeout_s: float = 120) -> openai.OpenAI:
    """The real `openai` client on the server or router at `url`; no retries (imported here: the GPU
    machine's tests use this module without the openai package)."""
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=timeout_s)


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
        stop(process)


def _wait_ready(deployment: Deployment) -> None:
    alive = lambda: deployment.process.poll() is None
    if wait_for_health(deployment.url, STARTUP_TIMEOUT_S, alive, interval_s=0.3):
        return
    if not alive():
        raise AssertionError(f"launcher exited with {deployment.process.returncode}\n{deployment.logs()}")
    raise AssertionError(f"deployment not healthy within {STARTUP_TIMEOUT_S} s\n{deployment.logs()}")


def stop(process: subprocess.Popen) -> None:
    """SIGTERM the launcher and wait for it (it drains and stops its children); SIGKILL after 90 s."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:  # the router, then the servers, drain first (server/deploy/drain.py)
            process.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)


@contextmanager
def served(tmp: Path, **settings) -> Iterator[tuple[str, subprocess.Popen]]:
    """One `pdserve serve --config` process: SERVER with `settings` over it, on a free port, its output
    in tmp/server.log. Yields (its URL, the process) once /health answers; terminates it on leaving
    if it still runs."""
    cfg = {**SERVER, **settings, "port": free_port()}
    (tmp / "server.yaml").write_text(yaml.safe_dump(cfg))
    log_path = tmp / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--config", str(tmp / "server.yaml")],
                                cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=log,
                                stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{cfg['port']}"
    try:
        wait_until(lambda: _healthy(url, proc), 120, what="server health", on_timeout=log_path.read_text)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=60)


def _healthy(url: str, proc: subprocess.Popen) -> bool:
    assert proc.poll() is None, "server exited"
    return answers_health(url)


def answers_health(url: str) -> bool:
    """The server at `url` answers 200 on /health (False while it is down or starting)."""
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def engine_child(server_pid: int) -> psutil.Process:
    """The engine process (`engine_process: true`) of the server process `server_pid`."""
    [child] = children_running(server_pid, "server.engine_host.main")
    return child


def live_children(pid: int, recursive: bool = True) -> list[tuple[psutil.Process, list[str]]]:
    """(process, argv) of every live descendant (or child) of `pid`. A child killed a moment ago stays a
    zombie until its parent reaps it; it is not running, so it is left out (its argv cannot be read)."""
    found = []
    for child in psutil.Process(pid).children(recursive=recursive):
        try:
            found.append((child, child.cmdline()))
        except (psutil.ZombieProcess, psutil.NoSuchProcess):
            continue
    return found


def children_running(pid: int, text: str) -> list[psutil.Process]:
    """The live direct children of `pid` whose command line contains `text`."""
    return [c for c, argv in live_children(pid, recursive=False) if text in " ".join(argv)]


def server_children(dep: Deployment, name: str) -> list[psutil.Process]:
    """The launcher's live children named `name` ("context-0", "generation-1", ...)."""
    return [c for c, argv in live_children(dep.process.pid) if argv[-2:] == ["--server", name]]


def server_pids(dep: Deployment, name: str) -> list[int]:
    """pids of the launcher's child `name`: none while it restarts."""
    return [c.pid for c in server_children(dep, name)]


def pid_of(dep: Deployment, name: str) -> int:
    [pid] = server_pids(dep, name)
    return pid


def back_again(dep: Deployment, name: str, old_pid: int, url: str) -> bool:
    """The launcher runs `name` again under a new pid, it answers /health at `url`, and the router says
    every server is healthy (before the new server is up, the router may not yet have found the old
    one gone)."""
    return server_pids(dep, name) not in ([], [old_pid]) and answers_health(url) and router_ready(dep.url)


def router_ready(url: str) -> bool:
    """The router at `url` answers /health, and says every server it routes to is healthy."""
    response = httpx.get(f"{url}/health", timeout=5)
    return response.status_code == 200 and all(s["healthy"] for s in response.json()["servers"].values())


def check_answers_and_streams(client: openai.OpenAI, model: str, prompt: str, max_tokens: int, question: str) -> None:
    """A greedy completion of `prompt` is transformers' text, and streamed it is the same; a greedy chat
    answer to `question` (12 tokens) equals its stream."""
    import hf_reference

    from server.models.builtin import resolve_model

    whole = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, **GREEDY)
    assert whole.choices[0].text == hf_reference.hf_text_ignore_eos(resolve_model(model), prompt, max_tokens)
    streamed = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == whole.choices[0].text
    messages = [{"role": "user", "content": question}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=12, **GREEDY)
    chunks = client.chat.completions.create(model=model, messages=messages, max_tokens=12, stream=True, **GREEDY)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content


def topic_prompts(fillers: int) -> list[str]:
    """One prompt per topic of TOPICS: the topic, FILLER `fillers` times, a request to answer."""
    return [f"Topic: {t}. " + FILLER * fillers + " Now answer briefly:" for t in TOPICS]


def completions(url: str, prompts: list[str], payload: dict, concurrent: bool = False) -> list[dict]:
    """Each prompt's /v1/completions answer (`payload`: the rest of the body; each status 200), the
    requests one after the other, or all at once."""
    async def one(client: httpx.AsyncClient, prompt: str) -> dict:
        response = await client.post(f"{url}/v1/completions", json={"prompt": prompt, **payload}, timeout=180)
        assert response.status_code == 200, response.text
        return response.json()

    async def run() -> list[dict]:
        async with httpx.AsyncClient() as client:
            if concurrent:
                return await asyncio.gather(*(one(client, p) for p in prompts))
            return [await one(client, p) for p in prompts]

    return asyncio.run(run())


def check_replays(url: str, prompts: list[str], payload: dict, reference: list[str], times: int) -> None:
    """The prompts one after the other, then `times` times all at once: every text is the reference's,
    and every replayed prompt hit the prefix cache."""
    first = completions(url, prompts, payload)
    assert [b["choices"][0]["text"] for b in first] == reference
    for _ in range(times):
        replay = completions(url, prompts, payload, concurrent=True)
        assert [b["choices"][0]["text"] for b in replay] == reference
        assert all(b["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 for b in replay)


def greedy_texts(url: str, prompts: list[str], max_tokens: int, timeout_s: float = 120) -> list[str]:
    """Each prompt's greedy completion text (ignore_eos) from `url`, one request at a time."""
    out = []
    for prompt in prompts:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=timeout_s)
        assert response.status_code == 200, response.text
        out.append(response.json()["choices"][0]["text"])
    return out


def bench(*args: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """`pdserve-bench ARGS` (`python -m pdserve_bench`) run to its end, checked to exit 0; its output."""
    done = subprocess.run([sys.executable, "-m", "pdserve_bench", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout_s)
    assert done.returncode == 0, f"pdserve-bench {args[0]} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done
