"""Streamed KV on one GPU: `pdserve launch` of the pair with `kv_stream: on` and
64-token prefill steps, so each prompt's blocks cross over (CUDA IPC batches, transceiver/sender/
stream.py, and with `same_host_ipc: false` the byte path) while the prompt is prefilled; the greedy
text equals the aggregated server's, every transfer was streamed, and no block stays in use.
Skipped without CUDA."""

from __future__ import annotations

import deploy_harness
import pytest
import torch
from waiting import wait_until

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PROMPTS = ["Topic: rivers. " + "filler words " * 40 + "Now answer briefly:", "abc " * 300, "The quick brown fox " * 30]
# No CUDA graphs on the context server: since mixed steps replay graphs (commit 039c15e), its 64-token
# chunks run as one-token rows through the decode kernels, not the prefill kernels the aggregated
# server's one-chunk prefill runs; with them the second prompt's greedy text parted within its 16
# tokens on the H200 (with graphs off it passes). bf16 rounding of other kernels is the
# likely cause (the rows are exact against transformers in float32: tests/gpu/test_async_cuda.py);
# the float32 run of this pair with graphs on, which would tell, is docs/GPU.md's next check. This
# test is about the KV crossing over while prefilled, so both servers compute alike here.
STREAMED = {"context_servers": {"kv_stream": "on", "max_num_tokens": 64, "cuda_graphs": False}}


def _texts(url: str) -> list[str]:
    return deploy_harness.greedy_texts(url, PROMPTS, 16, 120)


@pytest.mark.parametrize("same_host_ipc", [True, False])
def test_streamed_pair_on_one_gpu_matches_the_aggregated_server(tmp_path, same_host_ipc) -> None:
    for name in ("agg", "pair"):
        (tmp_path / name).mkdir()
    with deploy_harness.launched("aggregated.yaml", tmp_path / "agg") as agg:
        want = _texts(agg.url)
    overrides = {**STREAMED, "cache_transceiver_config": {"same_host_ipc": same_host_ipc}}
    with deploy_harness.launched("disagg.yaml", tmp_path / "pair", overrides) as pair:
        got = _texts(pair.url)
        gen, ctx = pair.generation_urls[0], pair.context_urls[0]
        assert pair.metric(gen, "pdserve_kv_transfer_streamed_total") == len(PROMPTS)
        for url in (ctx, gen):
            wait_until(lambda u=url: pair.metric(u, "pdserve_kv_cache_blocks", 'state="in_use"') == 0,
                       30, what=f"no block in use on {url}")
    assert got == want
