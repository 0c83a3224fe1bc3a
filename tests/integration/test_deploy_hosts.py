"""docs/DEPLOY.md's several-hosts example, run as written: three processes on three loopback addresses.

The YAML blocks are read from the page itself; only the addresses (10.0.0.1x -> 127.0.0.x) and the
ports (free ones) change. Each process reads the token from the file PDSERVE_AUTH_TOKEN_FILE names,
as the page says. A chat answer must come through the router with its KV pulled from the context
server's advertised address; with a generation server holding another token the request must fail
and no KV may move.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import deploy_harness as dh
import httpx
import pytest
import yaml
from waiting import wait_until

from pdserve_bench.launch import wait_for_health

DOC = dh.ROOT / "docs" / "DEPLOY.md"
HOSTS = {"10.0.0.10": "127.0.0.1", "10.0.0.11": "127.0.0.2", "10.0.0.12": "127.0.0.3"}
TOKEN = "deploy-doc-token-0123456789abcdef"
CHAT = {"messages": [{"role": "user", "content": "What is a generator?"}], "max_tokens": 24, "temperature": 0}


def doc_yaml(name: str) -> str:
    """The fenced YAML block of DEPLOY.md whose first line is `# <name>`."""
    for block in re.findall(r"```yaml\n(.*?)```", DOC.read_text(), re.S):
        if block.startswith(f"# {name}\n"):
            return block
    raise AssertionError(f"docs/DEPLOY.md has no yaml block starting with '# {name}'")


def localized(text: str, ports: dict[int, int]) -> dict:
    for doc_host, local in HOSTS.items():
        text = text.replace(doc_host, local)
    for doc_port, local in ports.items():
        text = re.sub(rf"\b{doc_port}\b", str(local), text)
    return yaml.safe_load(text)


@contextmanager
def process(args: list[str], log: Path, token: str) -> Iterator[subprocess.Popen]:
    token_file = log.with_suffix(".token")
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_AUTH_TOKEN"}
    env.update(PDSERVE_AUTH_TOKEN_FILE=str(token_file), HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "server.cli", *args], cwd=dh.ROOT, env=env,
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def start(stack: ExitStack, tmp: Path, name: str, cfg: dict, args: list[str], token: str = TOKEN) -> str:
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = stack.enter_context(process([*args, "--config", str(path)], tmp / f"{name}.log", token))
    url = f"http://{cfg['hostname'].replace('0.0.0.0', '127.0.0.1')}:{cfg['port']}"
    if not wait_for_health(url, dh.STARTUP_TIMEOUT_S, lambda: proc.poll() is None, interval_s=0.3):
        raise AssertionError(f"{name} not healthy:\n{(tmp / f'{name}.log').read_text()[-3000:]}")
    return url


@pytest.fixture()
def configs() -> dict[str, dict]:
    ports = {port: dh.free_port() for port in (8000, 8001, 8002, 9001)}
    return {name: localized(doc_yaml(f"{name}.yaml"), ports) for name in ("context", "generation", "deployment")}


def test_three_hosts_as_documented(tmp_path, configs):
    assert configs["context"]["cache_transceiver_config"]["host"] == "127.0.0.2"
    with ExitStack() as stack:
        ctx = start(stack, tmp_path, "context", configs["context"], ["serve", "--role", "context"])
        start(stack, tmp_path, "generation", configs["generation"], ["serve", "--role", "generation"])
        router = start(stack, tmp_path, "deployment", configs["deployment"], ["router"])
        answer = httpx.post(f"{router}/v1/chat/completions", json=CHAT, timeout=60)
        assert answer.status_code == 200, answer.text
        text = answer.json()["choices"][0]["message"]["content"]
        assert text.strip() and "\ufffd" not in text
        assert _metric(ctx, "pdserve_kv_transfer_bytes_total") > 0  # the KV went over tcp://127.0.0.2:port


def test_a_server_with_another_token_is_refused(tmp_path, configs):
    with ExitStack() as stack:
        ctx = start(stack, tmp_path, "context", configs["context"], ["serve", "--role", "context"])
        start(stack, tmp_path, "generation", configs["generation"], ["serve", "--role", "generation"],
              token="another-token-0123456789abcdef")
        router = start(stack, tmp_path, "deployment", configs["deployment"], ["router"])
        answer = httpx.post(f"{router}/v1/chat/completions", json=CHAT, timeout=60)
        assert answer.status_code == 401, answer.text  # the generation server refuses the router's leg
        assert answer.json()["error"]["type"] == "authentication_error"
        wait_until(lambda: _metric(ctx, "pdserve_kv_cache_blocks", 'state="in_use"') == 0, 10,
                   what="the context lease released")
        assert _metric(ctx, "pdserve_kv_transfer_bytes_total") == 0


def _metric(url: str, name: str, labels: str = "") -> float:
    """Sum of the samples of `name` whose labels contain `labels`; the metric must be there."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    samples = re.findall(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", text, re.M)
    chosen = [float(v) for lab, v in samples if labels in (lab or "")]
    assert chosen, f"{url}/metrics has no {name} sample with {labels!r}"
    return sum(chosen)
