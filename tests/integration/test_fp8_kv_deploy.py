"""An FP8 KV cache (`kv_cache_config.dtype: fp8`) on real processes.

- The host-offload pair of test_disagg_replay.py, FP8 on both sides: six prompts one by one, then
  five times all six at once; every text equals the FP8 aggregated server's, although blocks were
  offloaded to the host tier and onboarded again before they were sent. The pair moves the blocks
  as they are: the first pass sends the same blocks as the float32 pair of test_disagg_replay.py
  (FIRST_PASS_BLOCKS, measured there at 2 KiB a token), each a quarter of the size.
- The disk tier: an FP8 server's blocks go down to files; a restart with the same format finds them
  again and answers the same texts; a restart of a float32 cache on the same directory serves none
  of them (another dtype: the files are ignored) and answers transformers' texts.
"""

from __future__ import annotations

import asyncio

import deploy_harness as dh
import hf_reference
import pytest
from test_disagg_replay import FIRST_PASS_BLOCKS, _concurrent, _serial
from test_disk_tier_restart import PROMPTS as DISK_PROMPTS
from test_disk_tier_restart import _serial as disk_serial
from transformers import AutoTokenizer

from server.models.builtin import resolve_model

FP8 = {"kv_cache_config": {"dtype": "fp8"}}
FP8_PAIR = {"context_servers": FP8, "generation_servers": FP8}
BLOCK_BYTES = {"fp8": 32 * 512, "float32": 32 * 2048}  # tiny-llama: 32 tokens x (4 layers, K and V, 2 heads x 32)
TOKEN = "fp8-kv-deploy-test-token-0123456789"


def _texts(bodies: list[dict]) -> list[str]:
    return [b["choices"][0]["text"] for b in bodies]


@pytest.fixture(scope="module")
def fp8_reference(tmp_path_factory) -> list[str]:
    """The FP8 aggregated server's texts: the pair must equal them token for token."""
    with dh.launched("aggregated.yaml", tmp_path_factory.mktemp("agg"), FP8) as agg:
        return _texts(asyncio.run(_serial(agg.url)))


def _first_pass_bytes(dep: dh.Deployment, reference: list[str]) -> float:
    first = asyncio.run(_serial(dep.url))
    assert _texts(first) == reference
    return dep.metric(dep.generation_urls[0], "pdserve_kv_transfer_bytes_total")


def test_an_fp8_pair_equals_the_fp8_aggregated_server_through_host_offload(tmp_path, fp8_reference):
    with dh.launched("disagg_host_offload.yaml", tmp_path, FP8_PAIR) as dep:
        fp8_bytes = _first_pass_bytes(dep, fp8_reference)
        for _ in range(5):
            replay = asyncio.run(_concurrent(dep.url))
            assert _texts(replay) == fp8_reference
            assert all(b["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 for b in replay)
        ctx = dep.context_urls[0]
        assert dep.metric(ctx, "pdserve_kv_offloaded_blocks_total") > 0
        assert dep.metric(ctx, "pdserve_kv_onboarded_blocks_total") > 0
    assert fp8_bytes == FIRST_PASS_BLOCKS * BLOCK_BYTES["fp8"]  # a quarter of the float32 pair's
    assert BLOCK_BYTES["float32"] == 4 * BLOCK_BYTES["fp8"]


def test_fp8_blocks_on_disk_survive_a_restart_and_another_dtype_never_reads_them(tmp_path):
    block = BLOCK_BYTES["fp8"]
    disk = {"path": str(tmp_path / "kv-disk"), "max_bytes": 64 * block}
    cache = {"max_tokens": 256, "host_cache_size": 4 * block, "disk": disk}
    fp8 = {"cache_transceiver_config": {"auth_token": TOKEN}, "kv_cache_config": {**cache, "dtype": "fp8"}}
    for name in ("first", "second", "float32"):
        (tmp_path / name).mkdir()
    with dh.launched("aggregated.yaml", tmp_path / "first", fp8) as dep:
        first = _texts(disk_serial(dep.url))
        assert dep.metric(dep.url, "pdserve_kv_disk_offloaded_blocks_total") > 0
    assert list((tmp_path / "kv-disk" / "w2048").glob("*.kv"))

    with dh.launched("aggregated.yaml", tmp_path / "second", fp8) as dep:
        assert dep.metric(dep.url, "pdserve_kv_disk_restored_blocks_total") > 0
        again = disk_serial(dep.url)
        assert _texts(again) == first
        assert again[0]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 7 * 32  # its 7 full blocks
        assert dep.metric(dep.url, "pdserve_kv_disk_onboarded_blocks_total") >= 7
        assert dep.metric(dep.url, "pdserve_kv_disk_dropped_blocks_total") == 0

    float32 = {**fp8, "kv_cache_config": {**cache, "host_cache_size": 4 * BLOCK_BYTES["float32"]}}
    model_dir = resolve_model("builtin:tiny-llama")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    reference = [tokenizer.decode(hf_reference.hf_greedy_ignore_eos(model_dir, tokenizer.encode(p), 16),
                                  skip_special_tokens=True) for p in DISK_PROMPTS]
    with dh.launched("aggregated.yaml", tmp_path / "float32", float32) as dep:
        assert dep.metric(dep.url, "pdserve_kv_disk_restored_blocks_total") == 0
        bodies = disk_serial(dep.url)
        assert _texts(bodies) == reference
        assert bodies[0]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert "ignoring its" in (tmp_path / "float32" / "logs" / "aggregated-0.log").read_text(errors="replace")
