"""`pdserve-bench load` end to end: a real `pdserve serve` of builtin:tiny-llama on loopback, the
mixed workload from two client processes, records with per-run series, and `report` plotting them;
a real disaggregated pair (configs/disagg.yaml), whose runs break the time to first token down by
phase from the router's and the servers' /metrics."""

from __future__ import annotations

import math
from pathlib import Path

import deploy_harness as dh
import pytest
import yaml

from pdserve_bench.record import read_records

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300  # ~30 s on 2 idle cores; generous for a loaded CI machine


def test_mixed_load_from_two_processes_against_a_real_server(tmp_path):
    config = yaml.safe_load((ROOT / "configs" / "aggregated.yaml").read_text()) | {"model": "builtin:tiny-llama"}
    (tmp_path / "agg.yaml").write_text(yaml.safe_dump(config))
    out = tmp_path / "results"
    done = dh.bench("load", "--deploy", f"agg={tmp_path / 'agg.yaml'}", "--workload", "mixed", "--concurrency", "3",
                    "--input-len", "16", "--output-len", "8", "--long-input-len", "96", "--long-output-len", "4",
                    "--long-rate", "4", "--duration", "3", "--ramp-s", "0.5", "--client-procs", "2", "--window-s", "1",
                    "--no-warmup", "--repeat", "2", "--server-env", "OMP_NUM_THREADS=1", "--slo-ttft-ms", "60000",
                    "--slo-tpot-ms", "60000", "--out", str(out), timeout_s=TIMEOUT_S)
    assert "| agg: c=3 + 96in@4/s |" in done.stdout
    [record] = read_records([out])
    assert record["command"] == "load"
    assert record["config"] | {"slo": None, "server_env": None} == {
        "deployment": "agg", "target": "agg", "source": str(tmp_path / "agg.yaml"), "workload": "mixed",
        "figure": "c=3 + 96in@4/s", "concurrency": 3, "rate": 0.0, "input_len": 16, "output_len": 8,
        "duration_s": 3.0, "num_requests": None, "ramp_s": 0.5, "client_procs": 2, "window_s": 1.0, "bin_s": 1.0,
        "warmup": False, "repeat": 2, "slo": None, "server_env": None, "long_input_len": 96, "long_output_len": 4,
        "long_rate": 4.0, "long_requests": None}
    assert len(record["repeats"]) == 2 and len(record["series"]) == 2
    for run, series in zip(record["repeats"], record["series"], strict=True):
        assert run["errors"] == 0 and run["client_procs"] == 2.0 and run["client_busiest_core_share"] > 0
        assert run["background_requests"] + run["long_requests"] == run["requests"] > 0
        assert run["long_requests"] > 0 and run["slo_attainment"] == 1.0
        assert run["output_tokens"] == 8 * run["background_requests"] + 4 * run["long_requests"]
        assert 0 < run["background_tpot_p50_ms"] <= run["background_tpot_p99_ms"]
        assert 0 < run["long_ttft_p50_ms"] and 0 < run["server_ttft_mean_ms"] < run["ttft_mean_ms"]
        assert run["server_queue_mean_ms"] >= 0 and not math.isnan(run["ttft_mean_first_window_ms"])
        assert run["steady_output_tok_s"] > 0 and 0 < run["chunks_per_token"] <= 1
        # one aggregated server: its queue and prefill, once per request of the run; no router, no pair
        assert run["phase_context_queue_count"] == run["phase_prefill_count"] == run["requests"]
        assert 0 < run["phase_prefill_p50_ms"] and 0 < run["phase_prefill_mean_ms"] < run["server_ttft_mean_ms"]
        assert run["phase_first_event_count"] == run["phase_kv_transfer_count"] == 0
        assert math.isnan(run["phase_first_event_mean_ms"]) and math.isnan(run["phase_handoff_p50_ms"])
        assert len(series["t_s"]) == len(series["started"]) == len(series["output_tok_s"]) >= 3
        assert sum(series["started"]) == run["requests"]
        assert sum(series["output_tok_s"]) == pytest.approx(run["output_tokens"])  # 1-s bins: tokens per bin
    assert record["figures"]["startup_s"] > 0

    dh.bench("report", str(out), "--out", str(tmp_path / "report"), timeout_s=TIMEOUT_S)
    pngs = sorted(p.name for p in (tmp_path / "report").glob("*.png"))
    assert pngs == ["load-c-3-96in-4-s-series.png"]
    assert "## Load" in (tmp_path / "report" / "report.md").read_text()


PHASES = ("router_queue", "context_queue", "prefill", "context_leg", "handoff", "generation_queue", "kv_transfer",
          "generation_leg", "first_event")


def test_a_disaggregated_run_breaks_its_ttft_down_by_phase(tmp_path):
    config = yaml.safe_load((ROOT / "configs" / "disagg.yaml").read_text()) | {"model": "builtin:tiny-llama"}
    (tmp_path / "disagg.yaml").write_text(yaml.safe_dump(config))
    out = tmp_path / "results"
    done = dh.bench("load", "--deploy", f"disagg={tmp_path / 'disagg.yaml'}", "--concurrency", "2", "--input-len", "24",
                    "--output-len", "6", "--num-requests", "8", "--client-procs", "1", "--no-warmup",
                    "--server-env", "OMP_NUM_THREADS=1", "--out", str(out), timeout_s=TIMEOUT_S)
    assert "| TTFT phases, p50 / mean ms | router queue | context queue | prefill |" in done.stdout
    [record] = read_records([out])
    [run] = record["repeats"]
    assert run["requests"] == 8 and run["errors"] == 0
    assert {name: run[f"phase_{name}_count"] for name in PHASES} == dict.fromkeys(PHASES, 8.0)
    for name in PHASES:
        assert run[f"phase_{name}_mean_ms"] >= 0 and run[f"phase_{name}_p50_ms"] >= 0, name
    # the router sends the first token before the client reads it; its context leg spans the server's work
    assert run["phase_first_event_mean_ms"] < run["ttft_mean_ms"]
    assert run["phase_context_leg_mean_ms"] >= run["phase_context_queue_mean_ms"] + run["phase_prefill_mean_ms"]
    assert record["figures"]["phase_prefill_count"] == 8.0  # the record's medians carry them too
