"""Summarize py-spy collapsed stacks (`pdserve-bench sweep --profile DIR`): where the server's time goes.

    pdserve-bench profile /tmp/prof/agg.txt --top 25

Prints samples per process and thread, then the functions with the most samples on top of the
stack (self) and anywhere in the stack (inclusive), as a share of all samples. Line numbers are
dropped so that one function is one row. It reads a profile and measures nothing, so it writes
no record.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

HELP = "summarize py-spy collapsed stacks of a profiled sweep (no record)"
Stack = tuple[list[str], int]  # frames outermost first, sample count
_LINE = re.compile(r":\d+\)$")


def parse_collapsed(text: str) -> list[Stack]:
    """`frame;frame;...;frame COUNT` lines -> stacks (py-spy's raw format)."""
    stacks = []
    for line in text.splitlines():
        frames, _, count = line.rpartition(" ")
        if frames and count.isdigit():
            stacks.append((frames.split(";"), int(count)))
    return stacks


def function_of(frame: str) -> str:
    """`step (server/engine/core.py:92)` -> `step (server/engine/core.py)`."""
    return _LINE.sub(")", frame)


def short_process(frame: str, width: int = 70) -> str:
    """`process 17377:"python -m server.cli serve --config /tmp/x/aggregated.yaml"` shortened."""
    return frame if len(frame) <= width else "..." + frame[-width:]


def totals(stacks: list[Stack], *, with_entry: bool) -> Counter[str]:
    """Samples per process (the innermost `process ...` frame: py-spy nests children under their
    parent), and with `with_entry` per process and the function its thread started in."""
    out: Counter[str] = Counter()
    for frames, count in stacks:
        processes = [i for i, frame in enumerate(frames) if frame.startswith("process ")]
        last = processes[-1] if processes else -1  # -1: recorded without --subprocesses
        path = [short_process(frames[last])] if processes else []
        if with_entry and last + 1 < len(frames):
            path.append(function_of(frames[last + 1]))
        out[" / ".join(path)] += count
    return out


def self_and_inclusive(stacks: list[Stack]) -> tuple[Counter[str], Counter[str]]:
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    for frames, count in stacks:
        functions = [function_of(f) for f in frames]
        own[functions[-1]] += count
        for name in set(functions):
            inclusive[name] += count
    return own, inclusive


def _print_top(title: str, counts: Counter[str], total: int, top: int) -> None:
    print(f"\n{title}")
    for name, count in counts.most_common(top):
        print(f"{100.0 * count / total:6.1f}%  {count:7d}  {name}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", type=Path, help="py-spy raw (collapsed) output")
    parser.add_argument("--top", type=int, default=25)


def run(args: argparse.Namespace) -> int:
    stacks = parse_collapsed(args.path.read_text(errors="replace"))
    total = sum(count for _, count in stacks)
    if total == 0:
        raise SystemExit(f"{args.path}: no samples")
    print(f"{total} samples")
    _print_top("per process", totals(stacks, with_entry=False), total, args.top)
    _print_top("per process / thread entry", totals(stacks, with_entry=True), total, 8)
    own, inclusive = self_and_inclusive(stacks)
    _print_top("self (top of stack)", own, total, args.top)
    _print_top("inclusive", inclusive, total, args.top)
    return 0
