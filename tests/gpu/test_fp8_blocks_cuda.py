"""The block-scaled FP8 GEMM on CUDA (kernels/fp8_blocks.py, bf16 activations): DeepSeek-V3-sized
weights at decode and prefill row counts against the dequantized weight's float32 product, inside a
CUDA graph without host syncs, and its speed beside a bf16 GEMM of the same weight (printed: the
figure belongs to a benchmark, the test checks only that it runs). Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from runner_harness import no_host_syncs

from server.models.fp8.weight import FP8, from_block_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _weight(n: int, k: int):
    torch.manual_seed(n + k)
    q = (torch.randn(n, k, device="cuda") * 64).clamp(-448, 448).to(FP8)
    scale = (torch.rand(-(-n // 128), -(-k // 128), device="cuda") + 0.05) * 1e-3
    return from_block_checkpoint(q, scale, (128, 128), "w")


@pytest.mark.parametrize("rows", [1, 16, 64, 300, 2048])
@pytest.mark.parametrize(("n", "k"), [(7168, 2048), (4096, 7168), (300, 200)])
def test_block_gemm_computes_the_dequantized_product(rows: int, n: int, k: int) -> None:
    from server.models.kernels.fp8_blocks import block_fp8_gemm

    w = _weight(n, k)
    x = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")
    bias = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    got = block_fp8_gemm(x, w.qweight, w.scale, w.block_k, bias).float()
    ref = torch.nn.functional.linear(x.float(), w.dequantize(torch.float32), bias.float())
    assert (got - ref).abs().max() <= 1e-2 * ref.abs().max()  # one bf16 rounding of the output


def test_block_gemm_replays_in_a_graph_without_host_syncs() -> None:
    from server.models.kernels.fp8_blocks import block_fp8_gemm

    w = _weight(7168, 2048)
    x = torch.randn(4, 2048, dtype=torch.bfloat16, device="cuda")
    eager = block_fp8_gemm(x, w.qweight, w.scale, w.block_k, None)
    graph = torch.cuda.CUDAGraph()
    with no_host_syncs(), torch.cuda.graph(graph):
        out = block_fp8_gemm(x, w.qweight, w.scale, w.block_k, None)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    dense = w.dequantize(torch.bfloat16)
    times = {}
    for name, fn in (("fp8_block", lambda: block_fp8_gemm(x, w.qweight, w.scale, w.block_k, None)),
                     ("bf16", lambda: torch.nn.functional.linear(x, dense))):
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(50):
            fn()
        end.record()
        torch.cuda.synchronize()
        times[name] = start.elapsed_time(end) / 50 * 1000
    print(f"7168x2048 at 4 rows: {times} us")


@pytest.mark.parametrize("tokens", [1, 64, 300])
def test_grouped_block_scaled_experts_compute_the_dequantized_experts(tokens: int) -> None:
    """DeepSeek-V3's expert shapes (hidden 7168, intermediate 2048), 16 of them, top-8, bf16."""
    from server.models.fp8.weight import stack_experts
    from server.models.kernels.moe import fused_experts
    from server.models.moe.experts import dense_experts

    experts, hidden, inter, top_k = 16, 7168, 2048, 8
    gate_up = stack_experts([_weight(2 * inter, hidden) for _ in range(experts)])
    down = stack_experts([_weight(hidden, inter) for _ in range(experts)])
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device="cuda")
    ids = torch.stack([torch.randperm(experts, device="cuda")[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, device="cuda")
    got = fused_experts(x, gate_up, down, weights, ids).float()
    ref = dense_experts(x.float(), gate_up.dequantize(), down.dequantize(), weights, ids)
    assert (got - ref).abs().max() <= 2e-2 * ref.abs().max()


def test_warm_up_checks_keep_the_block_scaled_kernels_on_this_gpu() -> None:
    """The warm-up's checks (fp8/linear.py `choose` over BLOCKS and DEQUANT, kernels/moe.py
    `block_experts_compute`) find the kernels right here: the block-scaled GEMM computed within the
    tolerance and was timed at every row class, and the grouped experts are served."""
    from server.models.fp8.linear import Fp8Linears
    from server.models.fp8.weight import stack_experts
    from server.models.kernels.moe import block_experts_compute

    linears = Fp8Linears()
    linears.choose([_weight(7168, 2048)], [None], torch.bfloat16)
    rows = {key[-1] for key in linears.timings if key[:2] == (7168, 2048)}
    assert rows and all({"fp8_blocks", "dequantized"} <= set(linears.timings[(7168, 2048, r)]) for r in rows)
    print("block-scaled 7168x2048 paths:", linears.summary(), linears.timings)
    gate_up = stack_experts([_weight(2 * 2048, 7168) for _ in range(4)])
    down = stack_experts([_weight(7168, 2048) for _ in range(4)])
    assert block_experts_compute(gate_up, down, torch.bfloat16)
