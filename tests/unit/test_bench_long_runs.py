"""The long runs of `pdserve-bench` (soak, fuzz) and what they share with the other subcommands: the
overrides merged into a started deployment, its server URLs, the process serving a URL, the soak's
flatness summary and the fuzzer's answer check."""

from __future__ import annotations

import os
import subprocess
import sys

from pdserve_bench.cli import COMMANDS, build_parser
from pdserve_bench.fuzz import check
from pdserve_bench.launch import bench_deployment, merged, server_urls
from pdserve_bench.soak import PRESSURE, flat, listening_pid

BASE = {"model": "builtin:tiny-story", "port": 8000,
        "kv_cache_config": {"tokens_per_block": 32, "enable_block_reuse": True},
        "context_servers": {"num_instances": 1, "urls": ["127.0.0.1:8001"]},
        "generation_servers": {"num_instances": 1, "urls": ["127.0.0.1:8002"],
                               "cache_transceiver_config": {"kv_transfer_timeout_ms": 5000}}}


def test_overrides_merge_mapping_by_mapping_and_leave_both_inputs_alone():
    extra = {"model": "builtin:tiny-llama", "cache_transceiver_config": {"auth_token": "t" * 24},
             "generation_servers": {"cache_transceiver_config": {"auth_token": "g" * 24}}}
    out = bench_deployment(merged(BASE, extra), reuse=True)
    assert out["model"] == "builtin:tiny-llama" and out["cache_transceiver_config"] == {"auth_token": "t" * 24}
    assert out["generation_servers"]["cache_transceiver_config"] == {"kv_transfer_timeout_ms": 5000,
                                                                     "auth_token": "g" * 24}
    assert out["kv_cache_config"] == {"tokens_per_block": 32, "enable_block_reuse": True}
    assert BASE["model"] == "builtin:tiny-story" and "auth_token" not in str(BASE)
    assert server_urls(out, "context_servers") == [f"http://{out['context_servers']['urls'][0]}"]
    assert server_urls({"port": 1}, "context_servers") == []


def test_the_soak_pressure_keeps_the_shipped_sections():
    out = merged({"context_servers": {"num_instances": 1, "urls": ["a:1"]}}, PRESSURE)
    assert out["context_servers"]["num_instances"] == 1 and out["context_servers"]["max_batch_size"] == 16


def test_listening_pid_is_the_descendant_that_serves_the_port():
    code = ("import socket, sys; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); "
            "print(s.getsockname()[1], flush=True); sys.stdin.read()")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(child.stdout.readline())  # printed once it listens
        assert listening_pid(os.getpid(), f"http://127.0.0.1:{port}") == child.pid
    finally:
        child.stdin.close()
        child.wait(timeout=10)


def test_flat_compares_the_middle_third_with_the_last():
    rows = [{"ctx": {"rss_mib": v}} for v in (100, 200, 210, 210, 220, 220)]
    assert flat(rows, "ctx", "rss_mib") == {"middle_mean": 210.0, "last_mean": 220.0, "max": 220.0}


def test_fuzz_check_names_what_is_wrong_with_an_answer():
    assert check(200, "{}") is None
    assert check(400, '{"error": {"message": "bad", "type": "t", "param": null, "code": null}}') is None
    assert check(500, "boom").startswith("HTTP 500: boom")
    assert "without an OpenAI error body" in check(404, "not json")
    assert "lacks ['param']" in check(422, '{"error": {"message": "m", "type": "t", "code": null}}')


def test_soak_and_fuzz_are_subcommands_with_the_shared_flags():
    parser = build_parser(None)
    assert {"soak", "fuzz"} <= set(COMMANDS)
    soak = parser.parse_args(["soak", "--minutes", "0.5", "--no-record"])
    assert (soak.minutes, soak.streams, soak.no_record, soak.model) == (0.5, 64, True, "builtin:tiny-llama")
    fuzz = parser.parse_args(["fuzz", "--examples", "3", "--out", "x"])
    assert (fuzz.examples, str(fuzz.out)) == (3, "x")
