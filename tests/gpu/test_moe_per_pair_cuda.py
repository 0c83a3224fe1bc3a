"""The routed experts' per-pair tiles on CUDA (kernels/moe.py PER_PAIR_TILES): a Qwen3-30B-A3B-shaped
layer (128 experts, top-8, hidden 2048, intermediate 768) in bf16 at 1, 3 and 8 tokens on the 64
experts one of two expert-parallel ranks holds, against the float32 torch experts and the grouped tile;
the FP8 (W8A8) and block-scaled FP8 experts against their references; and a per-pair step captured in a
CUDA graph without host syncs, its replays equal to eager runs of the same inputs. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from fp8_reference import w8a8_experts
from runner_harness import no_host_syncs

from server.models.fp8.weight import FP8, from_block_checkpoint, quantize_weight, stack_experts
from server.models.moe.block import _held
from server.models.moe.experts import dense_experts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

EXPERTS, HIDDEN, INTER, TOP_K = 128, 2048, 768, 8


def _routing(tokens: int, experts: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, ids) of the rank holding the first half of `experts`: the other half's pairs get id
    experts // 2 and weight 0; the first token routed to expert 0 among others (so some pair is held and
    the reference is not all zeros), the last token of several routed wholly to the other rank."""
    scores = torch.rand(tokens, experts, device="cuda")
    scores[0, 0] = 2.0
    ids = scores.topk(top_k, dim=1).indices
    if tokens > 1:
        ids[-1] = torch.arange(experts - top_k, experts, device="cuda")
    weights = torch.rand(tokens, top_k, device="cuda")
    return _held((0, experts // 2), weights, ids)


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_per_pair_tiles_compute_the_torch_experts_in_bfloat16(tokens: int) -> None:
    from server.models.kernels.moe import PER_PAIR_TILES, fused_experts, tile_config

    torch.manual_seed(tokens)
    half = EXPERTS // 2
    gate_up = torch.randn(half, 2 * INTER, HIDDEN, dtype=torch.bfloat16, device="cuda") * HIDDEN ** -0.5
    down = torch.randn(half, HIDDEN, INTER, dtype=torch.bfloat16, device="cuda") * INTER ** -0.5
    x = torch.randn(tokens, HIDDEN, dtype=torch.bfloat16, device="cuda")
    weights, ids = _routing(tokens, EXPERTS, TOP_K)
    want = dense_experts(x.float(), gate_up.float(), down.float(), weights, ids.clamp(max=half - 1))
    grouped = fused_experts(x, gate_up, down, weights, ids, tile_config(ids.numel()))
    assert (ids == half).any() and want.abs().max() > 0
    for tile in PER_PAIR_TILES:
        got = fused_experts(x, gate_up, down, weights, ids, tile)
        if tokens > 1:
            assert torch.equal(got[-1], torch.zeros_like(got[-1])), tile
        # gate, up, SiLU, h and each pair's output rounded to bf16 (2^-9 each): as the grouped tile's
        assert _relative(got, want) < 2e-2 and _relative(got, grouped) < 2e-2, tile


@pytest.mark.parametrize("tokens", [1, 8])
def test_per_pair_tiles_compute_the_fp8_references(tokens: int) -> None:
    from server.models.kernels.moe import PER_PAIR_TILES, fused_experts, fused_fp8_experts

    torch.manual_seed(tokens)
    experts, hidden, inter, top_k = 16, 1024, 384, 4
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device="cuda")
    weights, ids = _routing(tokens, 2 * experts, top_k)
    w8a8 = [quantize_weight(torch.randn(experts, rows, cols, device="cuda") * 0.05)
            for rows, cols in ((2 * inter, hidden), (hidden, inter))]
    want_w8a8 = w8a8_experts(x, *w8a8, weights, ids.clamp(max=experts - 1))
    blocked = [stack_experts([_block_weight(rows, cols) for _ in range(experts)])
               for rows, cols in ((2 * inter, hidden), (hidden, inter))]
    want_blocked = dense_experts(x.float(), *(w.dequantize(torch.float32) for w in blocked), weights,
                                 ids.clamp(max=experts - 1))
    assert want_w8a8.abs().max() > 0 and want_blocked.abs().max() > 0
    for tile in PER_PAIR_TILES:
        # as tests/gpu/test_moe_fp8_cuda.py: h's e4m3 rounding may move a value by one code
        assert _relative(fused_fp8_experts(x, *w8a8, weights, ids, tile), want_w8a8) < 4e-2, tile
        assert _relative(fused_experts(x, *blocked, weights, ids, tile), want_blocked) < 2e-2, tile


def _block_weight(rows: int, cols: int):
    q = (torch.randn(rows, cols, device="cuda") * 64).clamp(-448, 448).to(FP8)
    scale = (torch.rand(-(-rows // 128), -(-cols // 128), device="cuda") + 0.05) * 1e-3
    return from_block_checkpoint(q, scale, (128, 128), "w")


def test_per_pair_step_replays_in_a_graph_without_host_syncs() -> None:
    from server.models.kernels.moe import PER_PAIR_TILES, fused_experts

    torch.manual_seed(0)
    gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, dtype=torch.bfloat16, device="cuda") * HIDDEN ** -0.5
    down = torch.randn(EXPERTS, HIDDEN, INTER, dtype=torch.bfloat16, device="cuda") * INTER ** -0.5
    x = torch.randn(4, HIDDEN, dtype=torch.bfloat16, device="cuda")
    weights, ids = _routing(4, EXPERTS, TOP_K)
    tile = PER_PAIR_TILES[0]
    fused_experts(x, gate_up, down, weights, ids, tile)  # compiled outside the checks
    with no_host_syncs():
        fused_experts(x, gate_up, down, weights, ids, tile)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # (a host sync while capturing fails the capture)
        out = fused_experts(x, gate_up, down, weights, ids, tile)
    for seed in (1, 2):  # new inputs in the captured tensors: the replay reads them
        torch.manual_seed(seed)
        step_weights, step_ids = _routing(4, EXPERTS, TOP_K)
        x.copy_(torch.randn_like(x))
        weights.copy_(step_weights)
        ids.copy_(step_ids)
        graph.replay()
        eager = fused_experts(x, gate_up, down, weights, ids, tile)
        assert torch.equal(out, eager)  # no atomics: the same sums in the same order
