"""A tensor-parallel aggregated server (`tensor_parallel_size: 2`, two real rank processes on gloo)
replays prompts through a small pool with a host tier, token for token against transformers.

The model is the sliding-window one (window 64 on two of its layers, prompts of ~200 tokens); the
primary pool holds 32 blocks, fewer than the six prompts need, so blocks are evicted to the host tier
and onboarded back: every rank must mirror those copies on its own slice of the pools (rank 0 keeps
the books), and replays read back exactly what was written (identical text, cached tokens > 0).
Once with the engine's steps one after the other, once with async scheduling forced on.
"""

from __future__ import annotations

import deploy_harness as dh
import hf_reference
import pytest
from transformers import AutoTokenizer
from waiting import wait_until

from server.models.builtin import resolve_model

MODEL = "builtin:tiny-qwen3-swa"
PROMPTS = dh.topic_prompts(3)
PAYLOAD = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
TP_AGGREGATED = {
    "model": MODEL, "device": "cpu", "max_seq_len": 512, "max_batch_size": 8, "max_num_tokens": 512,
    "tensor_parallel_size": 2,
    "kv_cache_config": {"tokens_per_block": 32, "max_tokens": 1024, "host_cache_size": 4 << 20,
                        "secondary_offload_min_priority": 0},
}


@pytest.fixture(scope="module")
def reference_texts() -> list[str]:
    model_dir = resolve_model(MODEL)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = [tokenizer.encode(p) for p in PROMPTS]
    assert min(len(i) for i in ids) > 128  # past the sliding window
    return [tokenizer.decode(hf_reference.hf_greedy_ignore_eos(model_dir, i, 12), skip_special_tokens=True)
            for i in ids]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_tp2_replay_through_host_tier_matches_transformers(tmp_path, reference_texts, async_scheduling):
    """With async scheduling forced on (a CPU's default is off), each decode row's token is the one
    the step before sampled on rank 0, which rank 1 gets by broadcast (server/tp/runner.py)."""
    with dh.launched("aggregated.yaml", tmp_path, {**TP_AGGREGATED, "async_scheduling": async_scheduling}) as dep:
        logs = "".join(p.read_text(errors="replace") for p in dep.log_dir.glob("*.log"))
        assert f"async scheduling {async_scheduling}" in logs
        dh.check_replays(dep.url, PROMPTS, PAYLOAD, reference_texts, 2)
        assert dep.metric(dep.url, "pdserve_kv_offloaded_blocks_total") > 0
        assert dep.metric(dep.url, "pdserve_kv_onboarded_blocks_total") > 0
        wait_until(lambda: dep.metric(dep.url, "pdserve_kv_cache_blocks", 'state="in_use"') == 0, 10,
                   what="no block in use")


RANK_BLOCK_BYTES = 32 * 1024  # tiny-qwen3-swa's block on one of two ranks: 32 tokens x 4 layers x K, V x 1 head x 32


def test_tp2_replay_through_host_and_disk_tiers_matches_transformers(tmp_path, reference_texts):
    """Blocks go down to disk and come back on both ranks: each rank writes its kv heads to files of
    its own (rank 1: `path.rank1`), and a hit reads both ranks' files (kvcache/disk_mirror.py)."""
    disk = {"path": str(tmp_path / "kv-disk"), "max_bytes": 64 * RANK_BLOCK_BYTES}
    # 16 primary and 2 host blocks per window group: the six prompts' ~42 blocks go on down to disk
    kv = {**TP_AGGREGATED["kv_cache_config"], "max_tokens": 512, "host_cache_size": 2 * RANK_BLOCK_BYTES,
          "disk": disk}
    with dh.launched("aggregated.yaml", tmp_path, {**TP_AGGREGATED, "kv_cache_config": kv}) as dep:
        dh.check_replays(dep.url, PROMPTS, PAYLOAD, reference_texts, 2)
        for name in ("offloaded", "onboarded", "disk_offloaded", "disk_onboarded"):
            assert dep.metric(dep.url, f"pdserve_kv_{name}_blocks_total") > 0, name
        assert dep.metric(dep.url, "pdserve_kv_disk_dropped_blocks_total") == 0
    for path in (tmp_path / "kv-disk", tmp_path / "kv-disk.rank1"):
        assert list(path.glob("w*/*.kv")), path
