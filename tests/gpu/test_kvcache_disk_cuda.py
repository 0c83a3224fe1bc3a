"""CUDA-only check of the disk tier: bf16 blocks go primary (GPU) -> pinned host -> files and come
back, while the same calls offload other blocks to the host pool on the DMA side streams (the CPU
touches a host row only after the DMAs using it finished: GroupPools._copy_disk). Bytes exact."""

from __future__ import annotations

import pytest
import torch
from kv_factories import make_manager
from waiting import wait_until

from kvcache import Level

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

TPB = 4


def test_blocks_round_trip_through_the_disk_tier_on_cuda(tmp_path):
    m = make_manager("cuda", tpb=TPB, primary_blocks=8, host_blocks=4, disk_blocks=32, windows=(64, 64),
                     max_seq_len=256, dim=8, dtype=torch.bfloat16, salt="fp", disk_dir=str(tmp_path / "kv"),
                     disk_key=b"k" * 32, secondary_offload_min_priority=0)
    prompts = [[100 * i + t for t in range(4 * TPB)] for i in range(6)]
    want = []
    for i, tokens in enumerate(prompts):  # 6 x 4 blocks through 8 primary + 4 host blocks
        m.admit(f"p{i}", tokens, max_cached_tokens=0)
        slots = m.slot_table(f"p{i}", 64)
        data = torch.randn((len(slots), *m.pool(64).shape[1:]), device="cuda").to(torch.bfloat16)
        m.pool(64)[slots] = data
        want.append(data)
        m.commit(f"p{i}", tokens, len(tokens))
        m.release(f"p{i}")
    assert m.stats().disk_offloads >= 8
    wait_until(lambda: m.stats().disk_queued_bytes == 0, 30, what="the disk writes to land")
    for i, tokens in enumerate(prompts):
        assert m.admit(f"q{i}", tokens + [7]) == len(tokens)  # nothing was dropped on the way
        torch.cuda.synchronize()
        got = m.pool(64)[m.slot_table(f"q{i}", 64)[:4]]
        assert torch.equal(got, want[i]), f"prompt {i}"
        m.release(f"q{i}")
    s = m.stats()
    assert s.disk_onboards >= 8 and s.disk_dropped == {}
    assert m.pool(64, Level.SECONDARY).is_pinned()
    m.check_integrity()
    m.close()
