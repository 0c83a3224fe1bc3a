"""A new user's first hour, with real processes: a port in use stops `pdserve launch`, `serve` and
`router` before anything starts, naming it; servers, router and launcher run without any extra's
package (as `pip install pdserve` installs them); each process
says where it listens; an idle pair logs nothing more as time passes; Ctrl-C ends a server and a
launch with 0 and no traceback, and the launch's token goes with it; `echo` with `max_tokens: 0`
goes through a router in front of aggregated servers as one server answers it (through a
disaggregated one: tests/integration/test_api_disagg.py, case echo_prompt_only)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import deploy_harness as dh
import httpx
import pytest
import yaml
from waiting import wait_until

ROOT = dh.ROOT
SMALL = {"max_seq_len": 256, "max_batch_size": 4, "max_num_tokens": 128,
         "kv_cache_config": {"tokens_per_block": 16, "max_tokens": 2048}}
PDSERVE = [sys.executable, "-m", "server.cli"]


def _env(tmp: Path | None = None, without_extras: Path | None = None) -> dict[str, str]:
    """The environment of a pdserve process: TMPDIR `tmp`; with `without_extras` (a folder to write
    to), it and every process it starts see none of the extras' packages (tests/import_blocker.py,
    installed by a sitecustomize)."""
    path = [str(ROOT), str(ROOT / "tests")]
    if without_extras is not None:
        without_extras.mkdir(exist_ok=True)
        (without_extras / "sitecustomize.py").write_text("import import_blocker\nimport_blocker.install()\n")
        path.insert(0, str(without_extras))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    return {**env, "TMPDIR": str(tmp)} if tmp else env


@contextmanager
def listening_on(port: int) -> Iterator[None]:
    """Another program's listener on 127.0.0.1:port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        yield


def _ports(cfg: dict) -> dict[str, tuple[str, int]]:
    """name -> (the key that sets it, port) for a disaggregated config of deploy_harness.write_config."""
    found = {"router": ("port", cfg["port"])}
    for section, role in (("context_servers", "context"), ("generation_servers", "generation")):
        for i, url in enumerate(cfg[section]["urls"]):
            found[f"{role}-{i}"] = (f"{section}.urls[{i}]", int(url.rsplit(":", 1)[1]))
    return found


# ---- a port in use ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["router", "context-0", "generation-0"])
def test_launch_with_a_port_in_use_starts_nothing_and_names_it(tmp_path, name):
    path, cfg = dh.write_config(ROOT / "configs" / "disagg.yaml", tmp_path)
    key, port = _ports(cfg)[name]
    (tmp_path / "tmp").mkdir()
    with listening_on(port):
        done = subprocess.run([sys.executable, "-m", "server.cli", "launch", str(path)], cwd=ROOT,
                              env=_env(tmp_path / "tmp"), capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"port {port} of {name} ({key} in {path}: 127.0.0.1:{port}): Address already in use" in done.stdout
    assert "nothing was started" in done.stdout
    assert "] started " not in done.stdout and "ready: " not in done.stdout and "logs in" not in done.stdout
    assert "Traceback" not in done.stderr
    assert list((tmp_path / "tmp").iterdir()) == []  # no log dir, no token


def test_serve_and_router_with_their_port_in_use_stop_before_loading(tmp_path):
    path, cfg = dh.write_config(ROOT / "configs" / "disagg.yaml", tmp_path)
    ports = _ports(cfg)
    commands = {"generation-0": ["serve", "--config", str(path), "--server", "generation-0"],
                "router": ["router", "--config", str(path)]}
    for name, argv in commands.items():
        key, port = ports[name]
        with listening_on(port):
            done = subprocess.run([sys.executable, "-m", "server.cli", *argv], cwd=ROOT, env=_env(),
                                  capture_output=True, text=True, timeout=120)
        assert done.returncode == 1, done.stdout + done.stderr
        assert f"cannot listen on 127.0.0.1:{port}" in done.stderr and "Address already in use" in done.stderr
        assert f"{key} in {path}" in done.stderr if name != "router" else f"port in {path}" in done.stderr
        assert "engine ready" not in done.stderr and "Traceback" not in done.stderr
    port = dh.free_port()
    with listening_on(port):
        done = subprocess.run([sys.executable, "-m", "server.cli", "serve", "builtin:tiny-llama", "--port", str(port)],
                              cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and f"cannot listen on 127.0.0.1:{port} for aggregated server (--port)" in done.stderr


# ---- one server, without the extras -----------------------------------------------------------

def test_serve_without_extras_says_where_it_listens_and_ends_with_0_on_ctrl_c(tmp_path):
    blocked = subprocess.run([sys.executable, "-c", "import openai"], env=_env(without_extras=tmp_path / "site"),
                             capture_output=True, text=True, timeout=60)
    assert blocked.returncode == 1 and "No module named 'openai'" in blocked.stderr  # as the server's process sees
    port = dh.free_port()
    out, err = tmp_path / "out", tmp_path / "err"
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.Popen([*PDSERVE, "serve", "builtin:tiny-llama", "--port", str(port), "--max-seq-len", "256"],
                                cwd=ROOT, env=_env(without_extras=tmp_path / "site"), stdout=o, stderr=e)
    line = f"pdserve: aggregated server listening on http://127.0.0.1:{port} (model builtin:tiny-llama, role " \
        "aggregated)"
    try:
        wait_until(lambda: line in out.read_text() or proc.poll() is not None, 120, "the listening line",
                   on_timeout=err.read_text)
        assert proc.poll() is None, err.read_text()
        body = {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
        response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4, response.text
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0, err.read_text()
    finally:
        proc.kill()
    assert out.read_text().count("listening on") == 1
    assert "Traceback" not in err.read_text() and "KeyboardInterrupt" not in err.read_text(), err.read_text()


# ---- a launch, by the README's way (no --log-dir) -----------------------------------------------

@dataclass
class Launch:
    proc: subprocess.Popen
    out: Path  # the launcher's stdout and stderr
    tmp: Path  # its TMPDIR
    cfg: dict
    path: Path

    def text(self) -> str:
        return self.out.read_text()

    @property
    def log_dir(self) -> Path:
        return Path(re.search(r"logs in (\S+)", self.text()).group(1))


@contextmanager
def launch(tmp_path: Path, config: str | dict) -> Iterator[Launch]:
    """`pdserve launch` of a shipped config (or of `config` itself, ports free), without --log-dir."""
    if isinstance(config, str):
        path, cfg = dh.write_config(ROOT / "configs" / config, tmp_path, SMALL)
    else:
        cfg, path = config, tmp_path / "deployment.yaml"
        path.write_text(yaml.safe_dump(cfg))
    tmp, out = tmp_path / "tmp", tmp_path / "launcher.out"
    tmp.mkdir()
    with open(out, "w") as f:
        proc = subprocess.Popen([*PDSERVE, "launch", str(path)], cwd=ROOT, env=_env(tmp, tmp_path / "site"),
                                stdout=f, stderr=subprocess.STDOUT)
    run = Launch(proc, out, tmp, cfg, path)
    try:
        wait_until(lambda: "ready: " in run.text() or proc.poll() is not None, dh.STARTUP_TIMEOUT_S, "ready",
                   on_timeout=run.text)
        assert proc.poll() is None, run.text()
        yield run
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=90)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    with launch(tmp_path_factory.mktemp("pair"), "disagg.yaml") as run:
        yield run


def test_each_process_says_where_it_listens(pair):
    ports, text = _ports(pair.cfg), pair.text()
    for name in ("context-0", "generation-0"):
        url, role = f"http://127.0.0.1:{ports[name][1]}", name.split("-")[0]
        assert f"{name} listening on {url} (model builtin:tiny-llama, role {role})" in text
        log = (pair.log_dir / f"{name}.log").read_text()
        assert log.count(f"pdserve: {name} listening on {url} (model builtin:tiny-llama, role {role})") == 1
    assert f"router listening on http://127.0.0.1:{ports['router'][1]} (policy round_robin)" in text
    log = (pair.log_dir / "router.log").read_text()
    assert f"pdserve: router listening on http://127.0.0.1:{ports['router'][1]} (policy round_robin, 1 context, " \
           "1 generation server(s))" in log
    ready = text.index("ready: ")
    assert all(text.index(f"{n} listening on") < ready for n in ("context-0", "generation-0", "router"))
    # the command to start a server again by hand runs as written: the venv's pdserve, named in full
    by_hand = re.search(r"to start one server again by hand: .* (\S+) serve --config", text).group(1)
    assert Path(by_hand).is_file() or by_hand.endswith("-m server.cli"), by_hand


def test_an_idle_pair_logs_nothing_more(pair):
    """The generation server asks its context server for its KV endpoint every few seconds; nothing of
    it, nor anything else periodic, reaches the logs at the default level."""
    httpx.post(f"http://127.0.0.1:{pair.cfg['port']}/v1/completions",
               json={"prompt": "Hello", "max_tokens": 2}, timeout=60).raise_for_status()
    time.sleep(1.0)  # the request's own lines, if any, are written

    def lines() -> dict[str, int]:
        logs = {p.name: len(p.read_text().splitlines()) for p in sorted(pair.log_dir.glob("*.log"))}
        return {**logs, "launcher": len(pair.text().splitlines())}

    before = lines()
    time.sleep(7.0)  # more than three rounds of every periodic task (the context directory: 2 s)
    after = lines()
    assert after == before, {name: "".join(
        (pair.log_dir / name).read_text().splitlines(True)[before[name]:]) for name in after if name != "launcher"
        and after[name] != before[name]}


def test_ctrl_c_ends_the_launch_with_0_and_removes_its_token(pair):
    token_file = pair.log_dir / "auth_token"
    assert token_file.stat().st_mode & 0o777 == 0o600 and pair.log_dir.stat().st_mode & 0o777 == 0o700
    pair.proc.send_signal(signal.SIGINT)
    assert pair.proc.wait(timeout=90) == 0, pair.text()
    assert "SIGINT: stopping" in pair.text() and "Traceback" not in pair.text()
    assert list(pair.tmp.iterdir()) == []  # the log dir, with the token, is gone


# ---- echo with max_tokens 0 through a router in front of aggregated servers ----------------------

def test_echo_without_generation_through_a_router_equals_one_server(tmp_path):
    router, server = dh.free_port(), dh.free_port()
    cfg = {"model": "builtin:tiny-llama", "port": router, "dtype": "float32", **SMALL,
           "generation_servers": {"num_instances": 1, "urls": [f"127.0.0.1:{server}"]}}
    body = {"prompt": "Once upon a time, in a land", "max_tokens": 0, "echo": True, "logprobs": 2}
    with launch(tmp_path, cfg):
        through, alone = (httpx.post(f"http://127.0.0.1:{p}/v1/completions", json=body, timeout=60)
                          for p in (router, server))
        assert through.status_code == 200, through.text
        assert through.json()["choices"] == alone.json()["choices"] and through.json()["usage"]["completion_tokens"] \
            == alone.json()["usage"]["completion_tokens"] == 0
        assert through.json()["choices"][0]["text"] == body["prompt"]
        no_echo = httpx.post(f"http://127.0.0.1:{router}/v1/completions", json={**body, "echo": False}, timeout=60)
        assert no_echo.status_code == 400 and "only for echo" in no_echo.json()["error"]["message"], no_echo.text
