"""scripts/bench_gpu_load.py (the one GPU command for serving under load) end to end on the CPU with builtin:tiny-llama
and tiny sizes: every phase runs (the burst phase on the launched deployment's fresh server and on
one restarted after phase e), prints its figures and goals, and leaves records, report and plots.
The figures themselves mean nothing here (2 shared cores); the GPU run is the lead's."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from pdserve_bench.record import read_records

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 600  # ~90 s on 2 idle cores: three deployments start, one of them three times
TINY = ["--model", "builtin:tiny-llama", "--max-seq-len", "2048", "--max-num-tokens", "2048", "--input-len", "16",
        "--output-len", "8", "--warm-concurrency", "2", "--warm-runs", "2", "--warm-duration", "1.5",
        "--peak-concurrency", "4", "--peak-duration", "1.5", "--b1-requests", "2", "--mixed-concurrency", "2",
        "--long-input-len", "128", "--long-output-len", "4", "--long-rate", "4", "--mixed-duration", "1.5",
        "--restart-duration", "1.5", "--ramp-s", "0.3", "--window-s", "1", "--with-extras", "--handoff-len", "256",
        "--handoff-prompts", "2", "--burst-concurrency", "3", "--burst-requests", "6", "--burst-runs", "2",
        "--client-procs", "1", "--server-env", "OMP_NUM_THREADS=1"]  # 2 client processes: test_bench_load_cli.py
GOALS = ["b_fresh_server_ttft", "b_fresh_client_ttft", "c_http_vs_engine_tok_s", "c_http_tpot_vs_engine_step",
         "c_http_vs_engine_closed_tok_s", "c_http_tpot_vs_engine_closed_step", "c_b1_tpot_vs_roofline",
         "d_peak_tok_s", "d_peak_ttft_p50", "d_mixed_bg_tpot_p99", "d_mixed_bg_itl_p99", "burst_fresh_server_ttft",
         "burst_fresh_client_ttft", "e_restart_server_ttft", "e_restart_client_ttft", "burst_restarted_server_ttft",
         "burst_restarted_client_ttft"]


def test_every_phase_runs_on_a_cpu_and_leaves_records_report_and_plots(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "scripts/bench_gpu_load.py", "--workdir", str(tmp_path / "work"),
                           "--out", str(out), *TINY], cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    lines = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
    phases = [x["phase"] for x in lines if "elapsed_s" in x]
    assert phases == ["a", "agg start", "b", "c", "d-agg", "f", "d-disagg", "launched start", "burst-fresh", "e",
                      "burst-restarted"]
    assert [x for x in lines if "error" in x] == []
    goals = {x["key"]: x for x in lines if x.get("figure") == "goal"}
    assert list(goals) == GOALS
    assert all(math.isfinite(g["ratio"]) and g["verdict"] in ("met", "MISSED") for g in goals.values())
    figures = {x["figure"]: x for x in lines if "figure" in x}
    assert figures["engine"]["engine_tok_s"] > 0 and figures["engine"]["hbm_read_gb_s"] > 0
    assert figures["engine"]["engine_closed_tok_s"] > 0 and figures["engine"]["engine_closed_step_ms"] > 0
    assert figures["restart"]["restart_s"] > 0 and figures["burst_restart"]["restart_s"] > 0
    assert figures["handoff"]["transfers"] == 2
    bursts = [x for x in lines if x.get("figure") in ("burst-fresh burst", "burst-restarted burst")]
    assert [(x["figure"], x["run"], x["requests"], x["errors"]) for x in bursts] == [
        ("burst-fresh burst", 1, 6, 0), ("burst-fresh burst", 2, 6, 0),
        ("burst-restarted burst", 1, 6, 0), ("burst-restarted burst", 2, 6, 0)]
    summary = json.loads(next(x for x in done.stdout.splitlines() if x.startswith("SUMMARY "))[len("SUMMARY "):])
    assert list(summary["goals"]) == GOALS

    records = read_records([out])
    groups = [(r["config"]["target"], r["config"]["figure"]) for r in records if r["command"] == "load"]
    assert groups == [("fresh", "first runs"), ("agg", "peak"), ("agg", "b1"), ("agg", "mixed"),
                      ("disagg", "peak"), ("disagg", "mixed"), ("burst-fresh", "burst"), ("restarted", "first runs"),
                      ("burst-restarted", "burst")]
    assert all(r["figures"]["errors"] == 0 for r in records if r["command"] == "load")
    [burst] = [r for r in records if r["command"] == "load" and r["config"]["target"] == "burst-fresh"]
    assert burst["config"]["plan"]["ramp_s"] == 0.0 and burst["config"]["plan"]["traffic"][0]["count"] == 6
    [total] = [r for r in records if r["command"] == "gpu-load"]
    assert set(GOALS) <= set(total["figures"])
    assert "## Goals" in (out / "report.md").read_text()
    assert sorted(p.name for p in (out / "plots").iterdir()) == ["first-runs.png", "mixed.png", "peak.png"]
