"""README.md's commands work as written: `pdserve` is always the virtual environment's (the install
puts it nowhere on PATH), each command and option it names exists, each file it names is there; the
run command installs for serving only and the test command the test extra, which .ci/run runs
verbatim. (The run command's deployment and its curl requests: tests/integration/test_first_run.py.)"""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

from server.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def bash_lines() -> list[str]:
    return [line for block in re.findall(r"```bash\n(.*?)```", README, re.S) for line in block.splitlines()]


def pdserve_commands() -> list[list[str]]:
    """argv after `pdserve` of every command the README writes, in code blocks or inline."""
    texts = bash_lines() + re.findall(r"`([^`\n]*pdserve [a-z][^`\n]*)`", README)
    found = []
    for text in texts:
        for part in re.split(r"&&|\|", text):
            words = shlex.split(part.replace("<", "").replace(">", ""))
            found += [words[i + 1:] for i, w in enumerate(words) if w.endswith("bin/pdserve") or w == "pdserve"]
    return found


def test_pdserve_is_always_the_venvs():
    bare = re.findall(r"(?<![/\w.-])pdserve (?:launch|serve|router|ray|calibrate-kv)\b", README)
    assert bare == [], "README names a bare pdserve command: say .venv/bin/pdserve"
    assert len(pdserve_commands()) >= 8


def test_each_command_and_option_exists():
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for argv in pdserve_commands():
        assert argv and argv[0] in subparsers.choices, argv
        options = subparsers.choices[argv[0]]._option_string_actions
        assert [w for w in argv[1:] if w.startswith("--") and w not in options] == [], argv


def test_each_file_named_is_there():
    named = set(re.findall(r"\b(configs/[\w.-]+\.yaml|scripts/[\w.-]+\.(?:sh|py)|docs/[\w.-]+\.(?:md|png))", README))
    named |= {f"configs/{name}" for name in re.findall(r"`([\w-]+\.yaml)`", README) if name != "server.yaml"}
    assert {"configs/disagg.yaml", "scripts/install.sh", "configs/aggregated.yaml"} <= named
    assert sorted(n for n in named if not (ROOT / n).exists()) == []


def test_run_installs_for_serving_and_tests_install_the_test_extra():
    lines = [line for line in bash_lines() if "scripts/install.sh" in line]
    run = [line for line in lines if "pdserve launch" in line]
    test = [line for line in lines if "pytest" in line]
    assert len(run) == 1 and len(test) == 1, lines
    assert "--test" not in run[0] and run[0].startswith("bash scripts/install.sh && ")
    assert test[0].startswith("bash scripts/install.sh --test && ")
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert ci[-1] == test[0]  # .ci/run ends with the README's test command, verbatim
    script = (ROOT / "scripts" / "install.sh").read_text()
    with_test, serving = script.split('if [ "$test_extra" = 1 ]; then')[1].split("\nelse\n")
    assert '-e "$here[test]"' in with_test and "apt-get" in with_test
    assert serving.strip().startswith('"$venv/bin/pip" install --quiet -e "$here"\n') and "apt-get" not in serving
