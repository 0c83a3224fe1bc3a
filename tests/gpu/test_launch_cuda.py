"""`pdserve launch` of the shipped configs on one GPU with default KV settings: both servers of the
disaggregated pair start (each sizes its pool from its share of the GPU, after its weights), the KV
crosses over, and the pair's greedy text equals the aggregated server's. Skipped without CUDA."""

from __future__ import annotations

import deploy_harness
import pytest
import torch
from waiting import wait_until

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PROMPTS = ["The quick brown fox", "Topic: rivers. " + "filler words " * 40 + "Now answer briefly:", "abc " * 200]


def _texts(url: str) -> list[str]:
    return deploy_harness.greedy_texts(url, PROMPTS, 24, 120)


def test_the_pair_shares_one_gpu_and_matches_the_aggregated_server(tmp_path) -> None:
    for name in ("agg", "pair"):
        (tmp_path / name).mkdir()
    with deploy_harness.launched("aggregated.yaml", tmp_path / "agg") as agg:
        want = _texts(agg.url)
    with deploy_harness.launched("disagg.yaml", tmp_path / "pair") as pair:
        got = _texts(pair.url)
        gen, ctx = pair.generation_urls[0], pair.context_urls[0]
        moved = pair.metric(gen, "pdserve_kv_transfer_bytes_total")
        wait_until(lambda: pair.metric(ctx, "pdserve_kv_cache_blocks", 'state="in_use"') == 0,
                   30, what="context blocks released")
    assert got == want
    assert moved > 0
