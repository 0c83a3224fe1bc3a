"""Rank 0's runner wrapper (server/tp/runner.py) offers everything the engine reads of its runner.

The engine sees a tensor-parallel server's `RankedRunner` where it would see a `ModelRunner`; an
attribute the engine starts to use and the wrapper lacks would fail only on a TP server. So every
`runner.NAME` that server/engine/ and server/engine_host/ read must be on `RankedRunner`, and `execute` must take what
`ModelRunner.execute` takes (the async pipeline's `PendingTokens` included).
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from server.models.runner import ModelRunner
from server.tp.runner import RankedRunner

SERVER = Path(__file__).resolve().parents[2] / "server"


def _runner_attributes() -> set[str]:
    """NAME of every `self.runner.NAME`, `core.runner.NAME` or `runner.NAME` in the engine's packages."""
    names = set()
    for path in [*(SERVER / "engine").glob("*.py"), *(SERVER / "engine_host").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            owner = node.value
            if (isinstance(owner, ast.Attribute) and owner.attr == "runner") or \
                    (isinstance(owner, ast.Name) and owner.id == "runner"):
                names.add(node.attr)
    return names


def test_the_wrapper_has_every_runner_attribute_the_engine_reads():
    used = _runner_attributes()
    assert {"execute", "spec", "device", "max_batch_size"} <= used  # the scan finds the engine's reads
    assert sorted(name for name in used if not hasattr(RankedRunner, name)) == []


def test_execute_takes_what_the_model_runner_takes():
    ours = inspect.signature(RankedRunner.execute).parameters
    theirs = inspect.signature(ModelRunner.execute).parameters
    assert list(ours) == list(theirs)
    assert [p.default for p in ours.values()] == [p.default for p in theirs.values()]
