"""`pip install pdserve` (no extras) serves: the serving entry points import, and `pdserve serve --help`
runs, in a Python where the extras' packages (test, bench, ray, cuda: tests/import_blocker.py) look
uninstalled; and pyproject.toml's own dependencies name none of them. (A real server runs that way in
tests/integration/test_first_hour.py.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from import_blocker import NOT_FOR_SERVING

ROOT = Path(__file__).resolve().parents[2]
ENTRY_POINTS = ("server.cli", "server.deploy.serve", "server.deploy.launcher", "server.router.app", "server.api.app",
                "server.models.runner", "kvcache", "transceiver.sender", "transceiver.receiver")
CHECK = f"""
import sys, importlib
import import_blocker
blocker = import_blocker.install()
for name in {ENTRY_POINTS!r}:
    importlib.import_module(name)
loaded = sorted(n for n in sys.modules if n.partition(".")[0] in import_blocker.NOT_FOR_SERVING)
assert not loaded, loaded
print("asked for:", sorted(set(blocker.asked)))
from server.cli import main
for command in ("serve", "launch", "router"):
    try:
        main([command, "--help"])
    except SystemExit as exc:
        assert exc.code == 0, (command, exc.code)
"""


def test_serving_imports_and_help_need_no_extra() -> None:
    path = os.pathsep.join([str(ROOT), str(ROOT / "tests")])
    done = subprocess.run([sys.executable, "-c", CHECK], cwd=ROOT, env={**os.environ, "PYTHONPATH": path},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "usage: pdserve serve" in done.stdout and "usage: pdserve launch" in done.stdout, done.stdout


def test_core_dependencies_name_no_extra_package() -> None:
    """The blocked packages are the test extra's (each there, by import name), and none is a core one."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0].lower().replace("-", "_") for d in project["dependencies"]}
    test = " ".join(project["optional-dependencies"]["test"]).replace("-", "_")
    assert [name for name in NOT_FOR_SERVING if name not in test] == []
    assert [d for d in core if any(d == name or d.endswith("_" + name) for name in NOT_FOR_SERVING)] == []
