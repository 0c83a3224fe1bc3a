"""The bench's one record format: a strict JSON line per measured point, NaN as null, checked on read."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from pdserve_bench.record import (
    RECORDS_FILE,
    RecordWriter,
    RunContext,
    cpu_model,
    dumps,
    git_info,
    loads,
    make_record,
    read_records,
)

CONTEXT = RunContext(argv=("pdserve-bench", "sweep", "--repeat", "2"),
                     machine={"cpu": "Test CPU", "cores": 2, "gpu": None, "torch": "2.13.0+cpu"},
                     git={"commit": "a" * 40, "dirty": False}, time="2026-12-03T10:00:00+00:00")


def test_a_record_is_one_strict_json_line_with_nan_as_null_and_back():
    record = make_record(CONTEXT, "sweep", {"target": "agg", "concurrency": 8},
                         {"ttft_p50_ms": 12.5, "tpot_p50_ms": math.nan},
                         [{"ttft_p50_ms": 12.0, "tpot_p50_ms": math.nan}, {"ttft_p50_ms": 13.0, "tpot_p50_ms": 2.0}])
    line = dumps(record)
    assert "\n" not in line and "NaN" not in line
    raw = json.loads(line)
    assert raw == {"schema": 1, "command": "sweep", "time": "2026-12-03T10:00:00+00:00",
                   "argv": ["pdserve-bench", "sweep", "--repeat", "2"],
                   "machine": {"cpu": "Test CPU", "cores": 2, "gpu": None, "torch": "2.13.0+cpu"},
                   "git": {"commit": "a" * 40, "dirty": False}, "config": {"target": "agg", "concurrency": 8},
                   "figures": {"ttft_p50_ms": 12.5, "tpot_p50_ms": None},
                   "repeats": [{"ttft_p50_ms": 12.0, "tpot_p50_ms": None}, {"ttft_p50_ms": 13.0, "tpot_p50_ms": 2.0}]}
    back = loads(line)
    assert back["figures"]["ttft_p50_ms"] == 12.5 and math.isnan(back["figures"]["tpot_p50_ms"])
    assert math.isnan(back["repeats"][0]["tpot_p50_ms"]) and back["repeats"][1]["tpot_p50_ms"] == 2.0


def test_nan_outside_the_figures_is_refused_rather_than_written_as_invalid_json():
    record = make_record(CONTEXT, "sweep", {"scale": math.nan}, {})
    with pytest.raises(ValueError):
        dumps(record)


def test_lines_that_are_not_records_are_refused_naming_where():
    good = json.loads(dumps(make_record(CONTEXT, "kvcache", {}, {"hit us/block": 2.0})))
    with pytest.raises(ValueError, match=r"f\.jsonl:3: not JSON"):
        loads("{nope", "f.jsonl:3")
    with pytest.raises(ValueError, match=r"missing \['figures'\]"):
        loads(json.dumps({k: v for k, v in good.items() if k != "figures"}))
    with pytest.raises(ValueError, match="schema 2"):
        loads(json.dumps({**good, "schema": 2}))
    with pytest.raises(ValueError, match="JSON object"):
        loads("[1, 2]")


def test_writer_appends_one_line_per_point_and_reader_reads_files_and_folders(tmp_path):
    out = RecordWriter(tmp_path / "run", CONTEXT)
    out.write("sweep", {"concurrency": 1}, {"output_tok_s": 100.0})
    out.write("sweep", {"concurrency": 8}, {"output_tok_s": 400.0}, [{"output_tok_s": 390.0}])
    again = RecordWriter(tmp_path / "run", CONTEXT)  # a second invocation appends
    again.write("router", {"requests": 10}, {"overhead_ms": 0.7})
    path = tmp_path / "run" / RECORDS_FILE
    assert len(path.read_text().splitlines()) == 3
    records = read_records([tmp_path / "run"])
    assert [(r["command"], r["figures"]) for r in records] == [
        ("sweep", {"output_tok_s": 100.0}), ("sweep", {"output_tok_s": 400.0}), ("router", {"overhead_ms": 0.7})]
    assert read_records([path]) == records
    assert len(out.written) == 2 and out.written[1]["repeats"] == [{"output_tok_s": 390.0}]


def test_writer_without_a_folder_keeps_the_records_in_memory_only(tmp_path):
    out = RecordWriter(None, CONTEXT)
    out.write("sweep", {}, {"x": 1.0})
    assert out.path is None and len(out.written) == 1 and list(tmp_path.iterdir()) == []


def test_machine_and_commit_are_read_from_this_machine_and_checkout():
    assert cpu_model("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Processor\nflags\t: fpu\n") == \
        "Intel(R) Xeon(R) Processor"
    assert cpu_model("processor : 0\n") == ""
    info = git_info()
    assert re.fullmatch(r"[0-9a-f]{40}", info["commit"]) and isinstance(info["dirty"], bool)
    context = RunContext.capture(["pdserve-bench", "report"])
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    assert context.machine["cores"] >= 1 and context.machine["gpu"] == gpu
    assert context.machine["torch"].startswith("2.") and context.git == info


def test_a_record_may_carry_series_per_repeat_with_nan_as_null():
    series = [{"t_s": [0.0, 1.0], "ttft_mean_ms": [12.5, math.nan]}, {"t_s": [0.0], "ttft_mean_ms": [9.0]}]
    record = make_record(CONTEXT, "load", {"target": "agg"}, {"ttft_mean_ms": 11.0}, [{}, {}], series)
    line = dumps(record)
    assert json.loads(line)["series"] == [{"t_s": [0.0, 1.0], "ttft_mean_ms": [12.5, None]},
                                          {"t_s": [0.0], "ttft_mean_ms": [9.0]}]
    back = loads(line)["series"]
    assert back[0]["ttft_mean_ms"][0] == 12.5 and math.isnan(back[0]["ttft_mean_ms"][1])
    assert back[1] == {"t_s": [0.0], "ttft_mean_ms": [9.0]}
    assert "series" not in make_record(CONTEXT, "sweep", {}, {})  # other records stay as they were
