#!/usr/bin/env bash
# One call on the GPU machine (the device tool): install the serving wheels carried in .whl
# (docs/GPU.md says which and why), then run what MODE names, logging under $OUT.
#   MODE: tests | bench | serving | profile | load | disk | tp | spec | kv_stream | api | fp8 | fp8kv | moe | all   (extra arguments go to the benchmark; TESTS=paths narrows tests)
#   moe: the MoE models (Qwen3-30B-A3B and DeepSeek-V2-Lite shapes, 16 layers): b1 TPOT and c=64 tok/s against their
#        rooflines, MLA KV bytes per token, aggregated = disaggregated texts (scripts/bench_gpu_moe.py); not part of `all'.
#   fp8kv: FP8 KV cache against bf16 KV, same run (handoff, host-tier hit, b64 x 2k decode; ~3 min); not part of `all'.
#   kv_stream: a 16k prompt's pair TTFT, KV streamed while prefilled vs sent after it; not part of `all'.
#   load (serving under load; run it alone): records.jsonl, report.md, plots/ and bench_gpu_load.log under $OUT
#   tp: tensor-parallel figures (scripts/bench_tp_gpu.py; sizes the GPUs allow), not part of `all'.
#   fp8: FP8 weights against bf16 (scripts/bench_gpu_fp8.py; `--kv-dtype fp8` adds the FP8 KV cache), not part of `all';
#        its tests: TESTS=tests/gpu/test_fp8_cuda.py bash scripts/device_gpu.sh tests
set -uo pipefail
mode="${1:-all}"; shift || true
out="${OUT:-/tmp/out}"; mkdir -p "$out"
python3 -c "import aiohttp; print('machine aiohttp', aiohttp.__version__)" || echo "machine has no aiohttp"
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PDSERVE_CACHE_DIR=/tmp/pdserve-cache
nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
nproc
# a mode cut short (timeout) can leave servers in their own sessions holding the GPU, their HTTP processes (no
# CUDA context) holding ports and a launcher's MPS daemon, after which the next pair under MPS failed to start
# (2026-12-07): clear all three after each mode
kill_gpu_leftovers() {
  for p in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader); do kill -9 "$p"; done
  pkill -9 -f -- "-m server.cli (serve|launch|router)"; pkill -9 -f "nvidia-cuda-mps-(control|server)"
  return 0
}
kill_gpu_leftovers  # an earlier call on this machine may have left some (a `timeout` stops only its child)
trap kill_gpu_leftovers EXIT
trap 'exit 143' TERM INT
if [[ "$mode" == tests || "$mode" == all ]]; then
  # SIGINT at TESTS_TIMEOUT_S: pytest then prints where it hung and its summary; the servers' logs come back
  timeout -s INT "${TESTS_TIMEOUT_S:-540}" python3 -m pytest -v --durations=15 ${TESTS:-tests/gpu} -p no:cacheprovider \
    2>&1 | tee "$out/tests_gpu.log" | tail -60
  find /tmp/pytest-of-* -path '*logs*' -name '*.log' 2>/dev/null | tar czf "$out/tests_gpu_server_logs.tgz" -T - 2>/dev/null
fi
if [[ "$mode" == bench || "$mode" == all ]]; then
  python3 scripts/bench_gpu.py --workdir /tmp/bench-gpu --out "$out/bench_gpu.jsonl" "$@" 2>&1 | tee "$out/bench_gpu.log" | grep -v '^SUMMARY'
fi
if [[ "$mode" == serving || "$mode" == all ]]; then
  python3 scripts/bench_gpu_serving.py --workdir /tmp/bench-gpu "$@" 2>&1 | tee "$out/bench_gpu_serving.log" | grep -v '^SUMMARY'
fi
if [[ "$mode" == tp ]]; then
  python3 scripts/bench_tp_gpu.py --workdir /tmp/bench-tp --out "$out/bench_tp_gpu.jsonl" "$@" 2>&1 | tee "$out/bench_tp_gpu.log" | grep -v '^SUMMARY'
fi
if [[ "$mode" == load ]]; then
  python3 scripts/bench_gpu_load.py --workdir /tmp/bench-gpu --out "$out" "$@" 2>&1 | tee "$out/bench_gpu_load.log" | grep -v '^SUMMARY'
fi
if [[ "$mode" == disk ]]; then  # not in `all`: it writes ~10 GB to WORKDIR's disk
  python3 scripts/bench_gpu_disk.py --workdir /tmp/bench-gpu --out "$out/bench_gpu_disk.jsonl" "$@" 2>&1 | tee "$out/bench_gpu_disk.log" | grep -v '^SUMMARY'
  python3 scripts/disk_floors.py --out "$out/disk_floors.json"  # the CPU's copy and MAC rates: a hit's floor
fi
if [[ "$mode" == fp8 ]]; then  # FP8 weights: b1 TPOT, c=64 tok/s and the linears' sweep, bf16 vs FP8
  python3 scripts/bench_gpu_fp8.py --workdir /tmp/bench-gpu --out "$out/bench_gpu_fp8.jsonl" "$@" 2>&1 | tee "$out/bench_gpu_fp8.log" | grep -v '^SUMMARY'
fi
if [[ "$mode" == spec ]]; then  # speculative decoding: b1 TPOT with and without, not in `all'
  python3 scripts/bench_gpu_spec.py --workdir /tmp/bench-gpu --out "$out/bench_gpu_spec.jsonl" "$@" 2>&1 | tee "$out/bench_gpu_spec.log" | grep -v '^SUMMARY'
fi
if [[ "$mode" == kv_stream ]]; then
  python3 scripts/bench_gpu_kv_stream.py --workdir /tmp/bench-gpu --out "$out/bench_gpu_kv_stream.jsonl" "$@" 2>&1 | tee "$out/bench_gpu_kv_stream.log" | grep -v '^SUMMARY'
  grep '^SUMMARY' "$out/bench_gpu_kv_stream.log"
fi
if [[ "$mode" == api ]]; then  # what the API's features cost under load (json_schema, logprobs, penalties, b1 grammar)
  python3 scripts/bench_gpu_api.py --workdir /tmp/bench-gpu --out "$out" "$@" 2>&1 | tee "$out/bench_gpu_api.log" | grep -v '^SUMMARY'
  grep '^SUMMARY' "$out/bench_gpu_api.log"
fi
if [[ "$mode" == fp8kv ]]; then
  python3 scripts/bench_gpu_fp8_kv.py --workdir /tmp/bench-gpu --out "$out/bench_gpu_fp8_kv.jsonl" "$@" 2>&1 | tee "$out/bench_gpu_fp8_kv.log" | grep -v '^SUMMARY'
fi
if [[ "$mode" == moe ]]; then
  python3 scripts/bench_gpu_moe.py --workdir /tmp/bench-moe --out "$out/bench_gpu_moe.jsonl" "$@" 2>&1 | tee "$out/bench_gpu_moe.log" | grep -v '^SUMMARY'
  grep '^SUMMARY' "$out/bench_gpu_moe.log"
fi
if [[ "$mode" == profile ]]; then
  python3 scripts/profile_gpu.py --workdir /tmp/bench-gpu "$@" 2>&1 | tee "$out/profile_gpu.log"
fi
