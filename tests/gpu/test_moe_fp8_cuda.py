"""FP8 routed experts on CUDA (bf16 activations): the grouped FP8 kernels (kernels/moe.py) against
their torch reference `w8a8_experts` at each tile config, and a MoE runner with `quantization: fp8` on
the Triton path: its experts run those kernels, its forward never syncs the host, and its decode graph
replays equal its eager steps. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from fp8_reference import w8a8_experts
from runner_harness import no_host_syncs

from kvcache import KvCacheConfig, KVCacheManager
from server.models.builtin import resolve_model
from server.models.fp8.weight import quantize_weight
from server.models.model_spec import load_spec
from server.models.runner import ModelRunner, SeqChunk

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("tokens", [1, 20, 300, 700])  # pairs of each tile config (kernels/moe.py tile_config)
def test_fused_fp8_experts_compute_the_reference_on_the_device(tokens: int) -> None:
    from server.models.kernels.moe import fused_fp8_experts

    torch.manual_seed(tokens)
    experts, hidden, inter, top_k = 8, 512, 384, 2
    gate_up = quantize_weight(torch.randn(experts, 2 * inter, hidden, device="cuda") * 0.05)
    down = quantize_weight(torch.randn(experts, hidden, inter, device="cuda") * 0.05)
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device="cuda")
    weights, ids = torch.rand(tokens, experts, device="cuda").softmax(-1).topk(top_k, dim=-1)
    want = w8a8_experts(x, gate_up, down, weights, ids).float()
    got = fused_fp8_experts(x, gate_up, down, weights, ids).float()
    # both quantize the SiLU-and-mul activations to e4m3 per token; a value that two summation orders put
    # on either side of a code boundary moves by one code (1/16-1/8 of itself), so the largest error over
    # 358k outputs is a few bf16 steps (0.0222 of the largest output at 700 tokens on an H100, 2026-12-06)
    # while the error overall stays at bf16's rounding
    error = ((got - want).abs().max() / want.abs().max()).item()
    overall = ((got - want).norm() / want.norm()).item()
    assert error < 4e-2 and overall < 1e-2, (error, overall)


def test_fp8_moe_runner_runs_the_fp8_kernels_in_graphs_without_host_syncs() -> None:
    from server.models.kernels.moe import fused_fp8_experts
    from server.models.moe import moe_blocks

    model_dir = resolve_model("builtin:tiny-qwen3-moe")
    device = torch.device("cuda")
    kv = KVCacheManager(KvCacheConfig(max_tokens=8192, tokens_per_block=32),
                        load_spec(model_dir).cache_layout(1024, torch.bfloat16, device))
    runner = ModelRunner(model_dir, kv, dtype=torch.bfloat16, device=device, max_num_tokens=1024, max_batch_size=8,
                         kernels="triton", cuda_graphs=True, max_seq_len=1024, quantization="fp8")
    runner.warm_up()
    assert all(b.experts is fused_fp8_experts for b in moe_blocks(runner.model).values())
    prompt = list(range(3, 43))
    kv.admit("r", prompt, num_tokens=64)
    tables = {w: kv.slot_table("r", w) for w in kv.window_sizes}
    first = runner.execute([SeqChunk(prompt, 0, tables, True)]).argmax(-1).tolist()
    chunks = [SeqChunk(first, len(prompt), tables, True)]
    inputs = runner.prepare(chunks)
    with no_host_syncs():
        eager = runner.forward(inputs)
    replayed = runner.execute(chunks)  # a decode row: the captured graph
    assert runner.graphs is not None and runner.graphs.graphs
    assert torch.isfinite(eager).all() and torch.equal(eager.argmax(-1), replayed.argmax(-1))
