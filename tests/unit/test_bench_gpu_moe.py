"""scripts/bench_gpu_moe.py on the CPU with --tiny: both models are built, served by engines and
measured; every figure is a JSON line with finite positive numbers, and the MLA KV bytes per token
against a dense cache of the same width is the arithmetic of the shapes (the real DeepSeek-V2-Lite
shape's from its config, the tiny engine's from its layout). The figures' values mean nothing on a CPU."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 120  # ~25 s on a busy box (one torch thread: several would fight the other processes)


def _figures(stdout: str) -> tuple[list[dict], dict]:
    rows = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    summary = next(line for line in stdout.splitlines() if line.startswith("SUMMARY "))
    return rows, json.loads(summary.removeprefix("SUMMARY "))


def _positive(row: dict, *keys: str) -> None:
    for key in keys:
        assert math.isfinite(row[key]) and row[key] > 0, (key, row)


def test_tiny_run_prints_every_figure_and_the_mla_kv_ratio(tmp_path):
    out = tmp_path / "records.jsonl"
    done = subprocess.run([sys.executable, "scripts/bench_gpu_moe.py", "--workdir", str(tmp_path / "work"), "--tiny",
                           "--skip", "texts", "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=TIMEOUT_S, env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    rows, summary = _figures(done.stdout)
    assert [json.loads(line) for line in out.read_text().splitlines()] == rows

    by = {(r["figure"], r.get("model"), r.get("source")): r for r in rows}
    _positive(by[("bandwidth", None, None)], "read_gb_s")
    for model, experts, top_k in (("qwen3moe", 8, 2), ("dsv2lite", 8, 2)):
        b1, c64 = by[("b1", model, None)], by[("c64", model, None)]
        _positive(b1, "tpot_ms", "step_bytes", "roofline_ms", "b1_vs_roofline")
        _positive(c64, "tok_s", "step_ms", "step_bytes", "roofline_tok_s", "c64_vs_roofline")
        assert c64["routing"] == "measured" and 1 <= c64["distinct_experts_per_layer"] <= experts
        assert c64["uniform_distinct_per_layer"] == experts * (1 - (1 - top_k / experts) ** c64["batch"])
        assert summary[model]["b1_tpot_ms"] == b1["tpot_ms"] and summary[model]["c64_tok_s"] == c64["tok_s"]

    kv = {r["source"].split()[0]: r for r in rows if r["figure"] == "kv_handoff"}
    real, engine = kv["layout"], kv["engine"]
    assert real["kv_mla_vs_dense"] == (512 + 64) / (2 * 16 * 128) == real["formula"]  # DeepSeek-V2-Lite's shape
    assert real["mla_bytes_per_token"] == 2 * (512 + 64) * 2 and real["met"]  # 2 layers, bf16
    assert engine["kv_mla_vs_dense"] == (32 + 16) / (2 * 4 * 16) == engine["formula"]  # the tiny shape's
    assert summary["kv_mla_vs_dense"] == {real["source"]: real["kv_mla_vs_dense"], "engine": engine["kv_mla_vs_dense"]}
