"""Layout skew is refused up front (Dynamo #14416).

A deployment whose generation servers use another tokens_per_block than its context server: the
generation server shakes hands with the context server in the background (it knows it from the
ContextDirectory), its /health turns 503 `incompatible` naming the field, and `pdserve launch` fails
before the router even starts, with that sentence. No request ever reaches a skewed pair.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import deploy_harness as dh

from server.deploy.launcher import HANDSHAKE_TIMEOUT_S


def test_skewed_pair_fails_the_launch_naming_the_field(tmp_path):
    skew = {"generation_servers": {"kv_cache_config": {"tokens_per_block": 16}}}
    path, cfg = dh.write_config(dh.ROOT / "configs" / "disagg.yaml", tmp_path, skew)
    out = tmp_path / "launcher.out"
    started = time.monotonic()
    with open(out, "wb") as sink:
        process = subprocess.run([sys.executable, "-m", "server.cli", "launch", str(path), "--log-dir",
                                  str(tmp_path / "logs")], cwd=dh.ROOT, stdout=sink, stderr=subprocess.STDOUT,
                                 env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)
    text = out.read_text()
    assert process.returncode == 1, text
    assert "tokens_per_block differs: context 32 vs generation 16" in text, text
    assert "started router" not in text  # refused before any request could come
    assert time.monotonic() - started < 120 + HANDSHAKE_TIMEOUT_S
