"""server/deploy/launcher.py with real child processes: tiny stdlib HTTP servers stand in for pdserve.

Each fake child serves GET /health on its Child.health_url and prints its pid, argv, the auth token
and the CUDA MPS variables it received to its log. Modes (extra argv per child name) make it slow,
crash or ignore SIGTERM.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from deploy_harness import free_ports
from waiting import wait_until

from server.config.schema import AUTH_TOKEN_ENV, HOSTNAME_ENV
from server.deploy.launcher import Child, LaunchOptions, launch

REPO = Path(__file__).resolve().parents[2]
FAKE_CHILD = r'''
import argparse, os, signal, subprocess, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

p = argparse.ArgumentParser()
p.add_argument("url")
p.add_argument("--health-delay", type=float, default=0.0)
p.add_argument("--exit-after", type=float, default=None)
p.add_argument("--code", type=int, default=0)
p.add_argument("--ignore-term", action="store_true")
p.add_argument("--grandchild", action="store_true")
p.add_argument("--die-times", type=int, default=None)  # with --exit-after: only the first N starts die
p.add_argument("--drain", type=float, default=None)  # on SIGTERM: log it, wait this long, exit 0
a = p.parse_args()
print(f"pid={os.getpid()} argv={sys.argv!r} token={os.environ.get('PDSERVE_AUTH_TOKEN')}", flush=True)
print("mps=" + " ".join(os.environ.get(k, "-") for k in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY",
                                                    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")), flush=True)
if a.die_times is not None:
    counter = os.path.join(os.path.dirname(os.path.abspath(__file__)), urlparse(a.url).netloc + ".starts")
    starts = int(open(counter).read()) if os.path.exists(counter) else 0
    open(counter, "w").write(str(starts + 1))
    if starts >= a.die_times:
        a.exit_after = None
if a.drain is not None:
    def on_term(*_):
        print(f"term at {time.time():.3f}", flush=True)
        time.sleep(a.drain)  # a server's drain takes this long: the order of stops is under test
        print(f"drained at {time.time():.3f}", flush=True)
        os._exit(0)
    signal.signal(signal.SIGTERM, on_term)
if a.grandchild:
    g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # lives until killed
    print(f"grandchild={g.pid}", flush=True)
if a.ignore_term:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if a.exit_after == 0:
    print("failing at start", flush=True)
    sys.exit(a.code)
ready_at = time.monotonic() + a.health_delay

class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        ok = self.path == "/health" and time.monotonic() >= ready_at
        self.send_response(200 if ok else 503)
        self.end_headers()

    def log_message(self, *args):
        pass

url = urlparse(a.url)
server = ThreadingHTTPServer((url.hostname, url.port), Health)
if a.exit_after:
    threading.Timer(a.exit_after, lambda: os._exit(a.code)).start()
server.serve_forever()
'''

RUNNER = r'''
import json, sys
from pathlib import Path
from server.deploy.launcher import LaunchOptions, launch

script, deployment, modes = sys.argv[1], sys.argv[2], json.loads(sys.argv[4])
log_dir = None if sys.argv[3] == "-" else Path(sys.argv[3])  # -: the launcher makes a temporary one
build = lambda child: [sys.executable, script, child.health_url, *modes.get(child.name, [])]
options = LaunchOptions(log_dir=log_dir, startup_timeout_s=30, poll_interval_s=0.05, grace_s=2, command=build)
sys.exit(launch(deployment, options))
'''


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv(AUTH_TOKEN_ENV, raising=False)
    monkeypatch.delenv(HOSTNAME_ENV, raising=False)


@pytest.fixture
def setup(tmp_path, request):
    """(deployment path: 1 context + 1 generation + router on free ports, fake child script, log dir).
    A test marked `restart(...)` sets the deployment's `restart:` mapping (default: never restart)."""
    ports = free_ports(3)
    marker = request.node.get_closest_marker("restart")
    restart = marker.kwargs if marker else {"max_quick_deaths": 0}
    deployment = tmp_path / "deploy.yaml"
    deployment.write_text(yaml.safe_dump({
        "model": "builtin:tiny-llama", "port": ports[0], "restart": restart, "drain_timeout_s": 3,
        "context_servers": {"num_instances": 1, "urls": [f"127.0.0.1:{ports[1]}"]},
        "generation_servers": {"num_instances": 1, "urls": [f"127.0.0.1:{ports[2]}"]},
    }))
    script = tmp_path / "fake_child.py"
    script.write_text(FAKE_CHILD)
    return deployment, script, tmp_path / "logs", ports


def port_is_free(port: int) -> bool:
    """No listener on the port (SO_REUSEADDR: TIME_WAIT leftovers of closed connections do not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def alive(pid: int) -> bool:
    """Running (zombies count as dead: our container's init may be slow to reap orphans)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def child_pids(log_dir: Path) -> dict[str, int]:
    """name -> pid, and name+'/grandchild' -> pid, from the fake children's logs."""
    pids = {}
    for log in log_dir.glob("*.log"):
        text = log.read_text()
        for key, label in (("pid", log.stem), ("grandchild", f"{log.stem}/grandchild")):
            m = re.search(rf"^{key}=(\d+)", text, re.M)
            if m:
                pids[label] = int(m.group(1))
    return pids


def builder(script: Path, modes: dict[str, list[str]]):
    return lambda child: [sys.executable, str(script), child.health_url, *modes.get(child.name, [])]


def run_inline(setup, modes: dict[str, list[str]], **options) -> int:
    deployment, script, log_dir, _ = setup
    opts = {"log_dir": log_dir, "startup_timeout_s": 20, "poll_interval_s": 0.05, "grace_s": 2, **options}
    return launch(deployment, LaunchOptions(command=builder(script, modes), **opts))


def start_runner(setup, modes: dict[str, list[str]], temp_log_dir: bool = False) -> tuple[subprocess.Popen, Path]:
    """The launcher in a process of its own; `temp_log_dir`: no --log-dir (it makes one under tmp/)."""
    deployment, script, log_dir, _ = setup
    runner, out = log_dir.parent / "runner.py", log_dir.parent / "launcher.out"
    runner.write_text(RUNNER)
    python_path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": python_path}
    if temp_log_dir:
        (log_dir.parent / "tmp").mkdir()
        env["TMPDIR"] = str(log_dir.parent / "tmp")
    with open(out, "wb") as f:
        proc = subprocess.Popen([sys.executable, str(runner), str(script), str(deployment),
                                 "-" if temp_log_dir else str(log_dir), json.dumps(modes)],
                                stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    return proc, out


def wait_ready(proc: subprocess.Popen, out: Path) -> None:
    wait_until(lambda: "ready: " in out.read_text() or proc.poll() is not None, 60, "the launcher's ready line")
    assert proc.poll() is None, out.read_text()


def health(port: int) -> int:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"http://127.0.0.1:{port}/health", timeout=5) as response:
        return response.status


def test_sigterm_stops_every_child_and_frees_ports(setup):
    proc, out = start_runner(setup, {"context-0": ["--grandchild"]})
    try:
        wait_ready(proc, out)
        ports = setup[3]
        assert [health(p) for p in ports] == [200, 200, 200]
        pids = child_pids(setup[2])
        assert sorted(pids) == ["context-0", "context-0/grandchild", "generation-0", "router"]
        assert all(alive(pid) for pid in pids.values())
        ready = f"ready: http://127.0.0.1:{ports[0]}  (router in front of 1 context, 1 generation server(s))"
        assert ready in out.read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        proc.kill()
    assert "SIGTERM: stopping" in out.read_text()
    assert [pid for pid in pids.values() if alive(pid)] == []
    assert [p for p in ports if not port_is_free(p)] == []


def test_token_travels_by_environment_only(setup):
    assert run_inline(setup, {"router": ["--exit-after", "0.3", "--code", "0"]}) == 1
    log_dir = setup[2]
    tokens = {re.search(r"token=(\S+)", log.read_text()).group(1) for log in log_dir.glob("*.log")}
    assert len(tokens) == 1
    token = tokens.pop()
    assert re.fullmatch(r"[0-9a-f]{64}", token)
    argv_lines = [re.search(r"argv=(.*) token=", log.read_text()).group(1) for log in log_dir.glob("*.log")]
    assert len(argv_lines) == 3 and all(token not in line for line in argv_lines)
    assert list(log_dir.glob("*.yaml")) == []  # no copy of any config: the servers read the deployment file
    assert token not in setup[0].read_text()
    assert not (log_dir / "auth_token").exists()  # there while the launch runs (test_token_file_...), not after


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])
def test_token_file_is_private_while_the_launch_runs_and_gone_after(setup, stop):
    """No --log-dir: the launcher's temporary log dir (0700) holds the token file (0600) an operator
    restarting a server by hand names (PDSERVE_AUTH_TOKEN_FILE: the deployment's token, as its children
    have it); a stop signal removes both, once the children are stopped."""
    proc, out = start_runner(setup, {}, temp_log_dir=True)
    tmp = setup[2].parent / "tmp"
    try:
        wait_ready(proc, out)
        log_dir = Path(re.search(r"logs in (\S+)", out.read_text()).group(1))
        assert log_dir.parent == tmp and log_dir.stat().st_mode & 0o777 == 0o700
        token_file = log_dir / "auth_token"
        assert token_file.stat().st_mode & 0o777 == 0o600
        assert re.search(rf"to start one server again by hand: PDSERVE_AUTH_TOKEN_FILE={token_file} ", out.read_text())
        children = {re.search(r"token=(\S+)", log.read_text()).group(1) for log in log_dir.glob("*.log")}
        assert children == {token_file.read_text()}
        deployment = setup[0]
        by_hand = subprocess.run([sys.executable, "-c", "import sys; from server.config.schema import load_server; "
                                  "print(load_server(sys.argv[1], 'generation-0').cache_transceiver_config.auth_token)",
                                  str(deployment)], env={**os.environ, "PDSERVE_AUTH_TOKEN_FILE": str(token_file)},
                                 cwd=REPO, capture_output=True, text=True, timeout=60)
        assert by_hand.stdout.strip() == token_file.read_text(), by_hand.stderr
        proc.send_signal(stop)
        assert proc.wait(timeout=15) == 0
    finally:
        proc.kill()
    assert list(tmp.iterdir()) == []  # the log dir and the token with it
    assert "Traceback" not in out.read_text()


def test_a_failed_launch_keeps_its_logs_but_not_the_token(setup, capsys, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(setup[2].parent))
    assert run_inline(setup, {"context-0": ["--exit-after", "0", "--code", "3"]}, log_dir=None) == 1
    log_dir = Path(re.search(r"logs kept in (\S+)", capsys.readouterr().out).group(1))
    assert log_dir.parent == setup[2].parent
    assert sorted(p.name for p in log_dir.iterdir()) == ["context-0.log", "generation-0.log"]


def test_child_exiting_at_startup_stops_everything(setup, capsys):
    assert run_inline(setup, {"context-0": ["--exit-after", "0", "--code", "3"],
                              "generation-0": ["--health-delay", "60"]}) == 1
    out = capsys.readouterr().out
    assert "context-0 exited during startup with exit code 3" in out
    assert "failing at start" in out  # the tail of its log
    assert "started router" not in out
    assert [pid for pid in child_pids(setup[2]).values() if alive(pid)] == []
    assert [p for p in setup[3] if not port_is_free(p)] == []


def test_startup_timeout_names_the_slow_child(setup, capsys):
    start = time.monotonic()
    assert run_inline(setup, {"generation-0": ["--health-delay", "60"]}, startup_timeout_s=1.5) == 1
    assert time.monotonic() - start < 10
    out = capsys.readouterr().out
    assert "startup timeout (1.5 s): no healthy /health from generation-0" in out
    assert [pid for pid in child_pids(setup[2]).values() if alive(pid)] == []
    assert [p for p in setup[3] if not port_is_free(p)] == []


def test_server_dying_later_is_reported_and_the_rest_keeps_running(setup):
    proc, out = start_runner(setup, {"generation-0": ["--exit-after", "2", "--code", "7"]})
    try:
        wait_ready(proc, out)
        wait_until(lambda: "generation-0 exited with exit code 7" in out.read_text(), 20, "the exit report")
        assert health(setup[3][0]) == 200 and health(setup[3][1]) == 200
        # the launcher still supervises: a later SIGINT is what stops it, with 0 (a launcher that had
        # decided to stop after the death would exit 1, saying the deployment cannot serve)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=15) == 0
        assert "SIGINT: stopping" in out.read_text() and "cannot serve any more" not in out.read_text()
    finally:
        proc.kill()
    assert [pid for pid in child_pids(setup[2]).values() if alive(pid)] == []


@pytest.mark.restart(max_quick_deaths=2, backoff_s=0.1)
def test_router_dying_quickly_is_given_up_stops_all_and_escalates_to_sigkill(setup, capsys):
    modes = {"router": ["--exit-after", "1", "--code", "5"], "context-0": ["--ignore-term"]}
    assert run_inline(setup, modes, grace_s=0.5) == 1
    out = capsys.readouterr().out
    assert out.count("router exited with exit code 5") == 2  # restarted once, then given up
    assert "restarting router in 0.1 s (quick deaths in a row: 1)" in out
    assert "GIVING UP on router: it died 2 times in a row within 60 s of starting" in out
    assert "the deployment cannot serve any more: stopping" in out
    assert "context-0 ignored SIGTERM for 3.5 s: SIGKILL" in out  # drain_timeout_s 3 + grace 0.5
    assert [pid for pid in child_pids(setup[2]).values() if alive(pid)] == []


def test_killed_launcher_takes_its_children_down(setup):
    proc, out = start_runner(setup, {})
    try:
        wait_ready(proc, out)
        pids = child_pids(setup[2])
        assert len(pids) == 3
        proc.kill()  # SIGKILL: no cleanup code runs; PR_SET_PDEATHSIG must do it
        proc.wait(timeout=10)
        wait_until(lambda: not any(alive(pid) for pid in pids.values()), 10, "the children to die")
    finally:
        proc.kill()
    wait_until(lambda: all(port_is_free(p) for p in setup[3]), 5, "ports to be released")


def test_aggregated_without_router(tmp_path, capsys):
    port = free_ports(1)[0]
    deployment = tmp_path / "agg.yaml"
    deployment.write_text(yaml.safe_dump({"model": "builtin:tiny-llama", "port": port,
                                          "restart": {"max_quick_deaths": 0}}))
    script = tmp_path / "fake_child.py"
    script.write_text(FAKE_CHILD)
    seen: list[Child] = []

    def build(child: Child) -> list[str]:
        seen.append(child)
        return [sys.executable, str(script), child.health_url, "--exit-after", "0.5", "--code", "0"]

    options = LaunchOptions(log_dir=tmp_path / "logs", poll_interval_s=0.05, grace_s=2, command=build)
    assert launch(deployment, options) == 1
    assert [(c.name, c.role, c.health_url) for c in seen] == [
        ("aggregated-0", "aggregated", f"http://127.0.0.1:{port}/health")]
    out = capsys.readouterr().out
    assert f"ready: http://127.0.0.1:{port}  (1 aggregated server(s))" in out
    assert "aggregated-0 exited with exit code 0" in out
    assert "aggregated-0 is not restarted (restart.max_quick_deaths is 0)" in out
    assert seen[0].config_path == deployment.resolve()  # the child reads the deployment file itself


# ---- supervision: restart, give up, ordered drain ---------------------------------------------

@pytest.mark.restart(max_quick_deaths=3, backoff_s=0.2)
def test_dead_server_is_restarted_on_its_port_with_backoff(setup):
    modes = {"generation-0": ["--exit-after", "1", "--code", "9", "--die-times", "2"]}
    proc, out = start_runner(setup, modes)
    try:
        wait_ready(proc, out)
        first = child_pids(setup[2])["generation-0"]
        wait_until(lambda: out.read_text().count("generation-0 is back: healthy") == 2, 30, "two restarts")
        text = out.read_text()
        assert "restarting generation-0 in 0.2 s (quick deaths in a row: 1)" in text
        assert "restarting generation-0 in 0.4 s (quick deaths in a row: 2)" in text  # backoff doubles
        assert "GIVING UP" not in text
        log = (setup[2] / "generation-0.log").read_text()
        pids = [int(p) for p in re.findall(r"^pid=(\d+)", log, re.M)]
        assert len(pids) == 3 and pids[0] == first and len(set(pids)) == 3  # two restarts, new processes
        assert health(setup[3][2]) == 200  # the same port
        assert alive(pids[-1]) and not alive(first)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        proc.kill()


@pytest.mark.restart(max_quick_deaths=3, backoff_s=0.05)
def test_a_server_that_keeps_dying_is_given_up_loudly_and_the_rest_serves(setup):
    proc, out = start_runner(setup, {"generation-0": ["--exit-after", "0.5", "--code", "4"]})
    try:
        wait_ready(proc, out)
        wait_until(lambda: "GIVING UP on generation-0" in out.read_text(), 30, "the launcher to give up")
        text = out.read_text()
        assert text.count("generation-0 exited with exit code 4") == 3
        assert "it died 3 times in a row within 60 s of starting (restart.max_quick_deaths)" in text
        assert health(setup[3][0]) == 200 and health(setup[3][1]) == 200
        # not the front: the launcher keeps the rest running until a later SIGINT (else: exit 1)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 0
        assert "SIGINT: stopping" in out.read_text() and "cannot serve any more" not in out.read_text()
    finally:
        proc.kill()


def test_stop_drains_the_router_before_the_servers(setup):
    modes = {name: ["--drain", "1.0"] for name in ("router", "context-0", "generation-0")}
    proc, out = start_runner(setup, modes)
    try:
        wait_ready(proc, out)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
    logs = {name: (setup[2] / f"{name}.log").read_text() for name in ("router", "context-0", "generation-0")}
    stamp = lambda name, what: float(re.search(rf"^{what} at (\S+)", logs[name], re.M).group(1))
    for server in ("context-0", "generation-0"):  # the router has drained before a server is told
        assert stamp(server, "term") >= stamp("router", "drained"), logs
