"""The bench tool end to end: `pdserve-bench sweep` starts a real aggregated server on loopback,
streams requests through the OpenAI API, writes JSON-lines records; `report` turns them into PNGs."""

from __future__ import annotations

from pathlib import Path

import deploy_harness as dh
import pytest

from pdserve_bench.record import read_records

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 240  # the run itself takes ~15 s on 2 idle cores; generous for a loaded CI machine


def test_sweep_against_a_real_server_writes_records_and_report_plots_them(tmp_path):
    out = tmp_path / "results"
    dh.bench("sweep", "--deploy", "agg=configs/aggregated.yaml", "--workload", "random", "multi-turn",
             "--concurrency", "1", "2", "--repeat", "1", "--input-len", "24", "--output-len", "6",
             "--num-prompts-c1", "2", "--num-prompts-per-slot", "2", "--conversations", "2", "--turns", "2",
             "--user-len", "40", "--turn-output-len", "4", "--quiet-max-busy", "1", "--slo-ttft-ms", "60000",
             "--slo-tpot-ms", "60000", "--out", str(out), timeout_s=TIMEOUT_S)
    records = read_records([out])
    assert [(r["command"], r["config"]["figure"]) for r in records] == [
        ("sweep", "random c=1"), ("sweep", "multi-turn c=1"), ("sweep", "random c=2"), ("sweep", "multi-turn c=2")]
    by_figure = {r["config"]["figure"]: r for r in records}
    random_c2 = by_figure["random c=2"]
    assert random_c2["config"] | {"slo": None} == {
        "deployment": "agg", "target": "agg", "source": "configs/aggregated.yaml", "reuse": True,
        "workload": "random", "figure": "random c=2", "concurrency": 2, "num_prompts": 4, "input_len": 24,
        "output_len": 6, "repeat": 1, "slo": None, "server_env": {}}
    figures = random_c2["figures"]
    assert figures["requests"] == 4 and figures["errors"] == 0 and figures["output_tokens"] == 4 * 6
    assert 0 < figures["ttft_p50_ms"] <= figures["ttft_p90_ms"] <= figures["ttft_p99_ms"]
    assert figures["slo_attainment"] == 1.0 and figures["goodput_req_s"] == figures["req_s"] > 0
    chat = by_figure["multi-turn c=2"]["figures"]
    assert chat["requests"] == 4 and chat["errors"] == 0
    # turn 1: 40 prompt tokens; turn 2: 40 + 4 (replayed answer) + 40 = 84, of which turn 1's full
    # 32-token block comes from the prefix cache; two conversations
    assert chat["cache_hit_rate"] == pytest.approx(2 * 32 / (2 * (40 + 84)))
    assert records[0]["git"]["commit"] and records[0]["machine"]["cores"] >= 1
    assert len(records[0]["repeats"]) == 1

    report = dh.bench("report", str(out), "--out", str(tmp_path / "report"), timeout_s=TIMEOUT_S)
    pngs = sorted(p.name for p in (tmp_path / "report").glob("*.png"))
    assert pngs == ["multi-turn-latency.png", "multi-turn-throughput.png",
                    "random-24in-6out-latency.png", "random-24in-6out-throughput.png"]
    for name in pngs:
        assert (tmp_path / "report" / name).read_bytes()[:4] == b"\x89PNG"
    assert "| agg: random c=2 | 4 | 0 |" in (tmp_path / "report" / "report.md").read_text()
    assert "wrote" in report.stdout
