"""The one result record of every benchmark: a JSON line per measured point.

A record is a flat JSON object:

    {"schema": 1, "command": "sweep", "time": "2026-12-05T10:00:00+00:00", "argv": [...],
     "machine": {"cpu": ..., "cores": 2, "gpu": null, "torch": "2.13.0+cpu", ...},
     "git": {"commit": "e869c10...", "dirty": false},
     "config": {...what was measured: deployment, workload, concurrency, sizes...},
     "figures": {...the point's numbers: medians over the repeats...},
     "repeats": [{...the same numbers, one dict per repeat...}]}

`figures` and `repeats` hold numbers only; NaN (nothing to measure, e.g. TPOT of one-token answers)
is written as null, so that every line is strict JSON, and read back as NaN.

A record may also hold `series`: one object per repeat, each a set of equally long columns of
numbers over time (`load`: per-second requests started, mean TTFT, output tok/s). Readers that do
not know the key ignore it; nulls in it are read back as NaN too.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCHEMA = 1
RECORDS_FILE = "records.jsonl"
REPO = Path(__file__).resolve().parents[1]
REQUIRED = ("schema", "command", "time", "machine", "git", "config", "figures", "repeats")


def cpu_model(cpuinfo: str) -> str:
    """The first `model name` of /proc/cpuinfo's text (empty when there is none)."""
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "model name":
            return value.strip()
    return ""


def machine_info() -> dict[str, Any]:
    """CPU model, cores (all / usable by this process), GPU name if any, library versions."""
    import torch
    import transformers

    try:
        cpu = cpu_model(Path("/proc/cpuinfo").read_text())
    except OSError:
        cpu = ""
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": cpu or platform.processor(), "cores": os.cpu_count(),
            "usable_cores": len(os.sched_getaffinity(0)), "gpu": gpu, "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "torch_threads": torch.get_num_threads()}


def git_info(repo: Path = REPO) -> dict[str, Any]:
    """The checked-out commit and whether the tree has uncommitted changes (None outside a checkout)."""
    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": None if status is None else bool(status)}


def _jsonable(value: float) -> float | None:
    return None if isinstance(value, float) and math.isnan(value) else value


def _numbers(figures: Mapping[str, float]) -> dict[str, float | None]:
    return {key: _jsonable(value) for key, value in figures.items()}


def _from_json(figures: Mapping[str, float | None]) -> dict[str, float]:
    return {key: math.nan if value is None else value for key, value in figures.items()}


@dataclass(frozen=True)
class RunContext:
    """What every record of one invocation shares: the command line, the machine, the commit, the time."""

    argv: tuple[str, ...]
    machine: Mapping[str, Any]
    git: Mapping[str, Any]
    time: str = field(default_factory=lambda: datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"))

    @classmethod
    def capture(cls, argv: Sequence[str]) -> RunContext:
        return cls(tuple(argv), machine_info(), git_info())


Columns = Mapping[str, Sequence[float]]


def _columns(series: Columns) -> dict[str, list[float | None]]:
    return {key: [_jsonable(v) for v in values] for key, values in series.items()}


def _columns_from_json(series: Mapping[str, Sequence[float | None]]) -> dict[str, list[float]]:
    return {key: [math.nan if v is None else v for v in values] for key, values in series.items()}


def make_record(context: RunContext, command: str, config: Mapping[str, Any], figures: Mapping[str, float],
                repeats: Sequence[Mapping[str, float]] = (), series: Sequence[Columns] = ()) -> dict[str, Any]:
    record = {"schema": SCHEMA, "command": command, "time": context.time, "argv": list(context.argv),
              "machine": dict(context.machine), "git": dict(context.git), "config": dict(config),
              "figures": _numbers(figures), "repeats": [_numbers(r) for r in repeats]}
    if series:
        record["series"] = [_columns(s) for s in series]
    return record


def dumps(record: Mapping[str, Any]) -> str:
    """One strict-JSON line (NaN anywhere is an error: `make_record` has turned figures' NaN into null)."""
    return json.dumps(record, allow_nan=False, sort_keys=False)


def loads(line: str, where: str = "<record>") -> dict[str, Any]:
    """One record back, figures' nulls as NaN; a line that is not a record is a ValueError naming `where`."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not JSON: {exc}") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: a record is a JSON object, got {type(record).__name__}")
    missing = [key for key in REQUIRED if key not in record]
    if missing:
        raise ValueError(f"{where}: not a bench record, missing {missing}")
    if record["schema"] != SCHEMA:
        raise ValueError(f"{where}: record schema {record['schema']}, this tool reads {SCHEMA}")
    record["figures"] = _from_json(record["figures"])
    record["repeats"] = [_from_json(r) for r in record["repeats"]]
    if "series" in record:
        record["series"] = [_columns_from_json(s) for s in record["series"]]
    return record


class RecordWriter:
    """Appends records to `out_dir/records.jsonl` (created on first write); `None` writes nowhere."""

    def __init__(self, out_dir: Path | None, context: RunContext) -> None:
        self.path = None if out_dir is None else out_dir / RECORDS_FILE
        self.context = context
        self.written: list[dict[str, Any]] = []

    def write(self, command: str, config: Mapping[str, Any], figures: Mapping[str, float],
              repeats: Sequence[Mapping[str, float]] = (), series: Sequence[Columns] = ()) -> dict[str, Any]:
        record = make_record(self.context, command, config, figures, repeats, series)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a") as out:
                out.write(dumps(record) + "\n")
        self.written.append(record)
        return record


def read_records(paths: Iterable[Path]) -> list[dict[str, Any]]:
    """Every record of these JSON-lines files (a folder means its records.jsonl), in file order."""
    records = []
    for path in paths:
        path = path / RECORDS_FILE if path.is_dir() else path
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                records.append(loads(line, f"{path}:{number}"))
    return records
