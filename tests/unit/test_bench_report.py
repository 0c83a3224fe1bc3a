"""The report step: records grouped per workload, PNG plots and markdown tables from hand-made records."""

from __future__ import annotations

import argparse

import pytest

from pdserve_bench import report
from pdserve_bench.record import RecordWriter, RunContext

CONTEXT = RunContext(argv=("pdserve-bench", "sweep"), machine={"cpu": "Test CPU", "cores": 2, "gpu": None,
                                                               "torch": "2.13.0+cpu", "transformers": "5.0"},
                     git={"commit": "0123456789abcdef", "dirty": True}, time="2026-12-03T10:00:00+00:00")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _figures(c: int, speed: float) -> dict[str, float]:
    out = {"requests": 8.0, "errors": 0.0, "output_tok_s": 100.0 * c * speed, "goodput_req_s": 2.0 * c,
           "slo_attainment": 1.0, "cache_hit_rate": 0.5 if speed > 1 else 0.0}
    for i, name in enumerate(("ttft", "tpot", "itl", "e2e")):
        for p in (50, 90, 99):
            out[f"{name}_p{p}_ms"] = (i + 1) * c * p / 50 / speed
    return out


def _point(out: RecordWriter, deployment: str, reuse: bool | None, workload: str, c: int, speed: float = 1.0,
           command: str = "sweep", **shape: object) -> None:
    target = deployment if reuse is not False else f"{deployment} reuse=off"
    name = f"{shape['grid_point']} " if workload == "grid" else ""
    config = {"deployment": deployment, "target": target, "reuse": reuse, "workload": workload,
              "figure": f"{workload} {name}c={c}", "concurrency": c, **shape,
              "slo": {"ttft_ms": 2000.0, "tpot_ms": 50.0}}
    figures = _figures(c, speed)
    out.write(command, config, figures, [figures, {k: v * 1.1 for k, v in figures.items()}])


@pytest.fixture
def records_dir(tmp_path):
    out = RecordWriter(tmp_path, CONTEXT)
    for c in (1, 2, 4):
        _point(out, "agg", True, "random", c, input_len=64, output_len=16)
        _point(out, "disagg", True, "random", c, 0.8, input_len=64, output_len=16)
        _point(out, "agg", True, "multi-turn", c, 2.0)
        _point(out, "agg", False, "multi-turn", c)
    for label in ("1k/1k", "8k/256"):
        _point(out, "agg", True, "grid", 2, grid_point=label, scale="1/16")
    out.write("router", {"requests": 10}, {"overhead_ms": 0.75})
    return tmp_path


def test_records_group_by_workload_and_pair_deployments_and_reuse(records_dir):
    families = report.latest_points(report.read_records([records_dir]))
    assert list(families) == ["random 64in-16out", "multi-turn", "grid x1/16"]
    random = families["random 64in-16out"]
    side = report.side_by_side_groups(random)
    assert list(side) == ["c=1", "c=2", "c=4"] and all(list(g) == ["agg", "disagg"] for g in side.values())
    assert report.reuse_groups(random) == {}
    chat = families["multi-turn"]
    assert report.side_by_side_groups(chat) == {}  # one deployment only
    reuse = report.reuse_groups(chat)
    assert list(reuse) == ["agg c=1", "agg c=2", "agg c=4"]
    assert reuse["agg c=2"]["reuse on"]["figures"]["cache_hit_rate"] == 0.5
    assert reuse["agg c=2"]["reuse off"]["config"]["target"] == "agg reuse=off"
    assert list(report.grid_groups(families["grid x1/16"])) == ["1k/1k\nc=2", "8k/256\nc=2"]


def test_report_writes_every_supported_plot_and_the_tables(records_dir, tmp_path):
    out = tmp_path / "report"
    args = argparse.Namespace(records=[records_dir / "records.jsonl"], out=out, prefix="cpu-", title="T")
    assert report.run(args) == 0
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == ["cpu-grid-x1-16.png", "cpu-multi-turn-latency.png", "cpu-multi-turn-reuse.png",
                    "cpu-multi-turn-throughput.png", "cpu-random-64in-16out-deployments.png",
                    "cpu-random-64in-16out-latency.png", "cpu-random-64in-16out-throughput.png"]
    for name in pngs:
        assert (out / name).read_bytes().startswith(PNG_MAGIC)
    text = (out / "cpu-report.md").read_text()
    assert text.startswith("# T\n\n15 records.\n")
    assert "- commit 0123456789 plus uncommitted changes" in text
    assert "Goodput counts requests within TTFT <= 2000 ms, TPOT <= 50 ms." in text
    assert "| agg: random c=2 | 8 | 0 | 200.0 | 4.00 | 100% | 2.0 | 3.6 | 4.0 | 4.00 |" in text
    assert "| disagg: random c=1 | 8 | 0 | 80.0 | 2.00 | 100% | 1.2 | 2.2 | 2.5 |" in text
    for name in pngs:
        assert f"({name})" in text
    assert "## router\n\n| config | overhead_ms |\n|---|---|\n| requests=10 | 0.75 |" in text


def test_report_of_compare_records_shows_the_goal_comparisons(tmp_path):
    out = RecordWriter(tmp_path, CONTEXT)
    for target, tok_s in (("aggregated", 400.0), ("hf", 100.0)):
        figure = "random c=8" if target == "aggregated" else "random c=1"
        config = {"target": target, "deployment": target, "reuse": None, "workload": "random", "figure": figure,
                  "concurrency": 8 if target == "aggregated" else 1, "input_len": 256, "output_len": 64}
        figures = {"output_tok_s": tok_s, "ttft_p50_ms": 10.0, "server_cpu_ms_per_token": 1.0}
        out.write("compare", config, figures, [figures, figures])
    args = argparse.Namespace(records=[tmp_path], out=tmp_path / "r", prefix="", title="T")
    report.run(args)
    text = (tmp_path / "r" / "report.md").read_text()
    assert "| aggregated c=8 tok/s / HF generate tok/s | 400.00 | 100.00 | 4.00x | 4.00x | 4.00x | >= 4x | met |" \
        in text


def test_report_without_records_says_so(tmp_path):
    (tmp_path / "records.jsonl").write_text("")
    with pytest.raises(SystemExit, match="no records"):
        report.run(argparse.Namespace(records=[tmp_path], out=None, prefix="", title="T"))


def _load_point(out: RecordWriter, target: str, figure: str, ttft: float, mixed: bool = False) -> None:
    figures = _figures(32, 1.0) | {"ttft_mean_ms": ttft, "ttft_mean_first_window_ms": 2 * ttft,
                                   "ttft_mean_later_ms": ttft, "first_vs_later_ttft": 2.0,
                                   "server_ttft_mean_ms": ttft / 2, "server_queue_mean_ms": 1.5}
    if mixed:
        figures |= {"background_tpot_p50_ms": 5.0, "background_tpot_p99_ms": 9.0, "background_itl_p99_ms": 30.0,
                    "long_ttft_p50_ms": 80.0, "long_tpot_p99_ms": 7.0}
    series = [{"t_s": [0.0, 1.0, 2.0], "ttft_mean_ms": [3 * ttft, ttft, ttft], "output_tok_s": [50.0, 90.0, 95.0]}]
    out.write("load", {"target": target, "figure": figure, "workload": "mixed" if mixed else "random"}, figures,
              [figures], series)


def test_load_records_get_their_tables_and_plots(tmp_path):
    out = RecordWriter(tmp_path, CONTEXT)
    _load_point(out, "agg", "c=32", 40.0)
    _load_point(out, "agg", "c=8 + 2048in@1/s", 50.0, mixed=True)
    _load_point(out, "disagg", "c=8 + 2048in@1/s", 60.0, mixed=True)
    args = argparse.Namespace(records=[tmp_path], out=tmp_path / "r", prefix="gpu-", title="T")
    assert report.run(args) == 0
    pngs = sorted(p.name for p in (tmp_path / "r").glob("*.png"))
    assert pngs == ["gpu-load-c-32-series.png", "gpu-load-c-8-2048in-1-s-series.png",
                    "gpu-load-c-8-2048in-1-s-targets.png"]
    for name in pngs:
        assert (tmp_path / "r" / name).read_bytes().startswith(PNG_MAGIC)
    text = (tmp_path / "r" / "gpu-report.md").read_text()
    assert "## Load" in text and "## load" not in text  # not again as an "other command" table
    assert "| agg: c=32 | 0 | - | 40.0 | 80.0 | 40.0 | 2.00 | 20.0 | 1.5 | - | - | - | - | - | - |" in text
    mixed = "| disagg: c=8 + 2048in@1/s | 0 | - | 60.0 | 120.0 | 60.0 | 2.00 | 30.0 | 1.5 | 5.00 | 9.00 | 30.00 |"
    assert mixed + " 80.0 | 7.00 | - |" in text
    for name in pngs:
        assert f"({name})" in text
