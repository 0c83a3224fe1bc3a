"""The benchmark client against the real HTTP API (the unit tests' fake engine) on a loopback port."""

from __future__ import annotations

import asyncio

import pytest
from test_api_engine_fake import FakeEngine
from waiting import uvicorn_in_thread

from pdserve_bench.client import run_workload, served_model
from pdserve_bench.launch import bench_deployment
from pdserve_bench.workloads import Workload
from server.api.app import create_app

START_TIMEOUT_S = 20.0


@pytest.fixture(scope="module")
def base_url():
    engine = FakeEngine(model_name="fake-model", max_seq_len=256)
    with uvicorn_in_thread(create_app(lambda: engine), START_TIMEOUT_S) as url:
        yield url


def test_streamed_requests_are_timed_and_counted_from_usage(base_url):
    repeated = list(range(40, 61))  # 21 tokens, sent twice: the fake caches 20 of them the 2nd time
    prompts = [repeated, list(range(70, 80)), repeated, list(range(90, 95))]
    results = asyncio.run(run_workload(base_url, "fake-model", Workload("t", prompts, 5), concurrency=2))
    assert [r.error for r in results] == [None] * 4
    assert [r.output_tokens for r in results] == [5, 5, 5, 5]
    assert [r.prompt_tokens for r in results] == [21, 10, 21, 5]
    assert [r.cached_tokens for r in results] == [0, 0, 20, 0]
    for r in results:
        assert len(r.chunk_times) == 5  # the fake streams one character per token
        assert r.start < r.first_token == r.chunk_times[0] <= r.chunk_times[-1] <= r.end
        assert r.tpot is not None and r.tpot >= 0


def test_http_errors_and_short_outputs_are_recorded_not_raised(base_url):
    bad = [[300]]  # outside the fake's 258-token vocabulary: HTTP 400
    results = asyncio.run(run_workload(base_url, "fake-model", Workload("t", bad, 5), concurrency=1))
    assert len(results) == 1 and results[0].error.startswith("HTTP 400: ")
    assert "outside the vocabulary" in results[0].error
    with pytest.raises(ValueError, match="concurrency"):
        asyncio.run(run_workload(base_url, "fake-model", Workload("t", bad, 5), concurrency=0))


def test_served_model_reads_v1_models(base_url):
    assert served_model(base_url) == "fake-model"


def test_bench_deployment_moves_every_server_to_free_ports_and_sets_reuse():
    base = {"port": 8000, "kv_cache_config": {"tokens_per_block": 32, "enable_block_reuse": True},
            "context_servers": {"num_instances": 1, "urls": ["127.0.0.1:8001"],
                                "kv_cache_config": {"enable_block_reuse": True}},
            "generation_servers": {"num_instances": 2, "urls": ["127.0.0.1:8002", "127.0.0.1:8003"]}}
    out = bench_deployment(base, reuse=False)
    ports = [out["port"]] + [int(u.rsplit(":", 1)[1]) for key in ("context_servers", "generation_servers")
                             for u in out[key]["urls"]]
    assert len(set(ports)) == 4 and 8000 not in ports
    assert out["kv_cache_config"] == {"tokens_per_block": 32, "enable_block_reuse": False}
    assert out["context_servers"]["kv_cache_config"] == {"enable_block_reuse": False}
    assert "kv_cache_config" not in out["generation_servers"]  # inherits the top level
    assert base["port"] == 8000 and base["kv_cache_config"]["enable_block_reuse"] is True  # not mutated


def test_a_conversation_sends_its_turns_one_after_the_other(base_url):
    # two conversations of three turns; each turn's prompt extends the last (as multi-turn draws them)
    first = [list(range(40, 50)), list(range(40, 60)), list(range(40, 70))]
    second = [list(range(100, 105)), list(range(100, 110)), list(range(100, 115))]
    workload = Workload("chat", first + second, 4, sessions=((0, 1, 2), (3, 4, 5)))
    results = asyncio.run(run_workload(base_url, "fake-model", workload, concurrency=2))
    assert [r.error for r in results] == [None] * 6
    assert [r.prompt_tokens for r in results] == [10, 20, 30, 5, 10, 15]  # results in prompt order
    for session in ((0, 1, 2), (3, 4, 5)):
        turns = [results[i] for i in session]
        for previous, current in zip(turns, turns[1:], strict=False):
            assert current.start >= previous.end  # the next turn waits for the answer
    assert results[3].start < results[0].end  # the two conversations ran side by side
