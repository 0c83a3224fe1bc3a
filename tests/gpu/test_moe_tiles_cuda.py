"""The grouped expert GEMMs' tile choice at warm-up on CUDA (kernels/moe.py `choose_tiles`): one
Qwen3-30B-A3B-shaped layer of experts (128 experts, top-8, hidden 2048, intermediate 768, bf16) gets a
tile per pair class, each one of the candidates, and a class's chosen tile is no slower than the
default tile by more than the timing's noise. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_warm_up_chooses_a_tile_per_pair_class() -> None:
    from server.models.kernels import moe
    from server.models.kernels.gemv import cuda_ms

    experts, hidden, inter, top_k = 128, 2048, 768, 8
    gate_up = torch.randn(experts, 2 * inter, hidden, dtype=torch.bfloat16, device="cuda") * 0.02
    down = torch.randn(experts, hidden, inter, dtype=torch.bfloat16, device="cuda") * 0.02
    moe.CHOSEN.clear()
    moe.choose_tiles(moe.fused_experts, gate_up, down, top_k, torch.bfloat16, max_tokens=512)
    chosen = {key[-1]: tile for key, tile in moe.CHOSEN.items()}
    assert sorted(chosen) == [8, 64, 256, 1024, 4096]
    for cls, tile in chosen.items():
        assert tile in moe.CANDIDATES[cls]
        tokens = max(1, cls // top_k)
        x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device="cuda")
        ids = torch.rand(tokens, experts, device="cuda").topk(top_k, dim=1).indices
        weights = torch.rand(tokens, top_k, device="cuda")
        step = (x, gate_up, down, weights, ids)
        ms = {name: cuda_ms(lambda t=t, s=step: moe.fused_experts(*s, t), repeats=20)
              for name, t in (("default", moe.tile_config(cls)), ("chosen", tile))}
        print(f"{cls} pairs: chosen {tile} {ms['chosen']:.3f} ms, default {ms['default']:.3f} ms")
        assert ms["chosen"] <= 1.15 * ms["default"]
    moe.CHOSEN.clear()
