"""FP8 routed experts (server/models/fp8/weight.py `stack_experts`, kernels/moe.py), float32 on a CPU.

Stacked experts quantize per expert and row exactly as each expert's own weight would; the CPU's torch
paths serve FP8 experts as the dequantized weights compute (bit for bit); the grouped FP8 Triton
kernels (through Triton's interpreter) equal their torch reference (tests/fp8_reference.py
`w8a8_experts`), which stays near the float experts; and a MoE model with `quantization: fp8` serves
transformers' tokens of the model its FP8 weights stand for (tests/fp8_checkpoints.py
`write_quantized_at_load`).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from fp8_reference import w8a8_experts
from test_moe import TOKENS, _ours

from server.models.fp8.weight import FP8, Fp8Weight, quantize_weight, stack_experts
from server.models.moe import route
from server.models.moe.block import MoEBlock, _held
from server.models.moe.experts import dense_experts, grouped_experts

HIDDEN = 64
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CUDA machine: the kernels compile there (tests/gpu covers them)")


def _fp8_block(case: str) -> tuple[MoEBlock, MoEBlock]:
    """(the block with FP8 experts, the same block with those experts dequantized to float32)."""
    block, _ = _ours(case, "stacked")
    q_gate_up, q_down = quantize_weight(block.gate_up), quantize_weight(block.down)
    fp8 = MoEBlock(block.spec, block.gate, block.correction, q_gate_up, q_down, block.shared, block.shared_gate)
    ref = MoEBlock(block.spec, block.gate, block.correction, q_gate_up.dequantize(), q_down.dequantize(),
                   block.shared, block.shared_gate)
    return fp8, ref


def test_stacked_experts_quantize_per_expert_and_row() -> None:
    w = torch.randn(5, 12, 40, generator=torch.Generator().manual_seed(1)) * torch.rand(5, 12, 1) * 3
    w[2, 7] = 0.0  # an all-zero row: a finite scale, zeros back
    stacked = quantize_weight(w)
    assert stacked.qweight.shape == (5, 12, 40) and stacked.qweight.dtype == FP8 and stacked.scale.shape == (5, 12)
    for e in range(5):
        own = quantize_weight(w[e])
        assert torch.equal(stacked.scale[e], own.scale)
        assert torch.equal(stacked.qweight[e].float(), own.qweight.float())
        assert torch.equal(stacked.expert(e).dequantize(), own.dequantize())
    assert torch.equal(stacked.dequantize()[2, 7], torch.zeros(40))
    assert (stacked.dequantize() - w).abs().max() <= w.abs().amax() / 16  # e4m3: 3 mantissa bits


def test_stack_experts_keeps_scales_and_dequantizes_mixed_parts() -> None:
    parts = [quantize_weight(torch.randn(6, 8, generator=torch.Generator().manual_seed(e))) for e in range(3)]
    stacked = stack_experts(parts)
    assert isinstance(stacked, Fp8Weight) and stacked.input_scale is None
    assert torch.equal(stacked.dequantize(), torch.stack([p.dequantize() for p in parts]))
    statics = [Fp8Weight(p.qweight, p.scale, torch.tensor([s])) for p, s in zip(parts, (0.5, 2.0, 1.0), strict=True)]
    assert stack_experts(statics).input_scale.tolist() == [2.0]  # the largest: no expert's inputs clip more
    mixed = stack_experts([parts[0], parts[1].dequantize(), parts[2]])
    assert isinstance(mixed, torch.Tensor) and torch.equal(mixed, torch.stack([p.dequantize() for p in parts]))


@pytest.mark.parametrize("case", ["mixtral", "qwen2-moe", "deepseek-v3"])
def test_cpu_paths_compute_the_dequantized_experts(case: str) -> None:
    """The torch paths (grouped: the CPU's; dense: CUDA's torch path) on FP8 experts give exactly what
    the same block gives with the experts dequantized offline."""
    fp8, ref = _fp8_block(case)
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(2))
    from server.models.ops import TorchOps

    want = ref(x, TorchOps(1e-6))
    assert torch.equal(fp8(x, TorchOps(1e-6)), want)
    weights, ids = route(fp8.spec, x, fp8.gate, fp8.correction)
    assert torch.equal(dense_experts(x, fp8.gate_up, fp8.down, weights, ids),
                       dense_experts(x, ref.gate_up, ref.down, weights, ids))


def test_w8a8_reference_stays_near_the_float_experts() -> None:
    fp8, ref = _fp8_block("qwen3-moe")
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(4))
    weights, ids = route(fp8.spec, x, fp8.gate)
    want = grouped_experts(x, ref.gate_up, ref.down, weights, ids)
    got = w8a8_experts(x, fp8.gate_up, fp8.down, weights, ids)
    assert not torch.equal(got, want)  # the activations are rounded to e4m3
    assert (got - want).abs().max() < 0.08 * want.abs().max()


@interpreted
@pytest.mark.parametrize(("tokens", "static"), [(1, False), (5, False), (37, False), (9, True)])
def test_fused_fp8_experts_equal_the_torch_reference(tokens: int, static: bool) -> None:
    """The grouped FP8 kernels (Triton's interpreter) against `w8a8_experts`: a decode row, a few rows,
    a prefill's worth of pairs, and a static checkpoint's input scales."""
    pytest.importorskip("triton")
    from server.models.kernels.moe import fused_fp8_experts

    fp8, _ = _fp8_block("qwen3-moe")
    gate_up, down = fp8.gate_up, fp8.down
    if static:
        gate_up = Fp8Weight(gate_up.qweight, gate_up.scale, torch.tensor([4.0 / 448]))
        down = Fp8Weight(down.qweight, down.scale, torch.tensor([2.0 / 448]))
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens))
    weights, ids = route(fp8.spec, x, fp8.gate)
    want = w8a8_experts(x, gate_up, down, weights, ids)
    got = fused_fp8_experts(x, gate_up, down, weights, ids)
    assert (got - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())


@interpreted
def test_fused_fp8_expert_parallel_shares_sum_to_the_whole() -> None:
    """Expert parallelism: each of 4 ranks runs its 2 FP8 experts (other ranks' pairs: id E, weight 0)."""
    pytest.importorskip("triton")
    from server.models.kernels.moe import fused_fp8_experts

    fp8, _ = _fp8_block("mixtral")
    x = torch.randn(12, HIDDEN, generator=torch.Generator().manual_seed(8))
    weights, ids = route(fp8.spec, x, fp8.gate)
    whole = w8a8_experts(x, fp8.gate_up, fp8.down, weights, ids)
    parts = []
    for rank in range(4):
        w, i = _held((2 * rank, 2 * rank + 2), weights, ids)
        gate_up = Fp8Weight(fp8.gate_up.qweight[2 * rank:2 * rank + 2], fp8.gate_up.scale[2 * rank:2 * rank + 2])
        down = Fp8Weight(fp8.down.qweight[2 * rank:2 * rank + 2], fp8.down.scale[2 * rank:2 * rank + 2])
        parts.append(fused_fp8_experts(x, gate_up, down, w, i))
    assert (sum(parts) - whole).abs().max().item() < 1e-5


@interpreted
@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_fused_fp8_experts_per_pair_tiles_equal_the_torch_reference(tokens: int) -> None:
    """The per-pair tiles (kernels/moe.py PER_PAIR_TILES) of the FP8 experts (W8A8, interpreted) on the
    4 of 8 experts one rank holds (the others' pairs: id E, weight 0) against `w8a8_experts`."""
    pytest.importorskip("triton")
    from server.models.kernels.moe import PER_PAIR_TILES, fused_fp8_experts

    fp8, _ = _fp8_block("qwen3-moe")
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(30 + tokens))
    weights, ids = _held((4, 8), *route(fp8.spec, x, fp8.gate))
    gate_up, down = (Fp8Weight(w.qweight[4:], w.scale[4:]) for w in (fp8.gate_up, fp8.down))
    want = w8a8_experts(x, gate_up, down, weights, ids.clamp(max=3))
    assert (ids == 4).any() and want.abs().max().item() > 0.1
    for tile in PER_PAIR_TILES:
        got = fused_fp8_experts(x, gate_up, down, weights, ids, tile)
        assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item(), tile


@pytest.mark.parametrize("model", ["builtin:tiny-mixtral", "builtin:tiny-qwen2-moe", "builtin:tiny-deepseek-v3"])
def test_quantization_fp8_loads_fp8_experts_and_float_routers(model: str) -> None:
    from server.models.builtin import resolve_model
    from server.models.fp8.load import load_checkpoint
    from server.models.model_spec import load_spec, with_quantization

    spec = with_quantization(load_spec(resolve_model(model)), "fp8")
    tensors = load_checkpoint(spec, dtype=torch.float32, device=torch.device("cpu"), quantization="fp8")
    experts = [n for n in tensors if ".experts." in n and n.endswith("weight")]
    assert experts and all(isinstance(tensors[n], Fp8Weight) for n in experts)
    routers = [n for n in tensors if n.endswith((".gate.weight", "shared_expert_gate.weight"))]
    assert routers and all(isinstance(tensors[n], torch.Tensor) for n in routers)
    assert spec.fingerprint != load_spec(resolve_model(model)).fingerprint


@pytest.mark.parametrize("model", ["builtin:tiny-mixtral", "builtin:tiny-qwen3-moe", "builtin:tiny-deepseek-v3"])
def test_moe_engine_with_fp8_serves_transformers_tokens_of_its_weights(model: str, tmp_path: Path) -> None:
    import engine_harness as eh
    import hf_reference
    from fp8_checkpoints import write_quantized_at_load
    from prompts import random_prompt

    from server.models.builtin import resolve_model

    reference = write_quantized_at_load(resolve_model(model), tmp_path / "ref")
    prompts = [random_prompt(70 + i, n) for i, n in enumerate([7, 40])]
    got = [r.token_ids for r in eh.generate(eh.make_core(model, quantization="fp8"), prompts, eh.greedy(12))]
    want = [hf_reference.hf_greedy_ignore_eos(reference, p, 12) for p in prompts]
    assert got == want
    plain = [r.token_ids for r in eh.generate(eh.make_core(model), prompts, eh.greedy(12))]
    assert plain != got  # the FP8 rounding changes this random model's tokens: the test sees the weights


@pytest.mark.parametrize(("model", "layout", "per", "static", "scale_name"), [
    ("builtin:tiny-qwen2-moe", "hf-fp8", "channel", False, "weight_scale_inv"),
    ("builtin:tiny-mixtral", "compressed-tensors", "tensor", True, "weight_scale"),
])
def test_fp8_moe_checkpoint_serves_transformers_tokens_of_its_weights(model: str, layout: str, per: str,
                                                                       static: bool, scale_name: str,
                                                                       tmp_path: Path) -> None:
    """An FP8 MoE checkpoint (experts, shared expert and dense linears in FP8, as tests/fp8_checkpoints.py
    writes them) serves what transformers computes of its dequantized weights."""
    import engine_harness as eh
    import hf_reference
    from fp8_checkpoints import write_dequantized, write_fp8
    from prompts import random_prompt

    from server.models.builtin import resolve_model

    fp8_dir = write_fp8(resolve_model(model), tmp_path / "fp8", layout, per, static, scale_name)
    reference = write_dequantized(fp8_dir, tmp_path / "ref")
    core = eh.make_core(str(fp8_dir))
    block = next(layer.mlp for layer in core.runner.model.layers if isinstance(layer.mlp, MoEBlock))
    assert isinstance(block.gate_up, Fp8Weight) and isinstance(block.down, Fp8Weight)
    prompts = [random_prompt(80 + i, n) for i, n in enumerate([9, 33])]
    got = [r.token_ids for r in eh.generate(core, prompts, eh.greedy(12))]
    assert got == [hf_reference.hf_greedy_ignore_eos(reference, p, 12) for p in prompts]


@interpreted
def test_triton_runner_runs_fp8_experts_through_the_grouped_fp8_kernels() -> None:
    """A MoE runner on the Triton path (interpreted) with `quantization: fp8`: every sparse layer's
    experts run `fused_fp8_experts`, and each call returns what `w8a8_experts` computes of its input
    (checked per call, as tests/unit/test_fp8_kernels.py checks the FP8 linears)."""
    pytest.importorskip("triton")
    from prompts import random_prompt

    from kvcache import KvCacheConfig, KVCacheManager
    from server.models.builtin import resolve_model
    from server.models.kernels.moe import fused_fp8_experts
    from server.models.model_spec import load_spec
    from server.models.moe import moe_blocks
    from server.models.runner import ModelRunner, SeqChunk

    model_dir = resolve_model("builtin:tiny-qwen3-moe")
    kv = KVCacheManager(KvCacheConfig(max_tokens=1024, tokens_per_block=16),
                        load_spec(model_dir).cache_layout(256, torch.float32, "cpu"))
    runner = ModelRunner(model_dir, kv, dtype=torch.float32, device=torch.device("cpu"), max_num_tokens=128,
                         max_batch_size=2, kernels="triton", cuda_graphs=False, quantization="fp8")
    blocks = moe_blocks(runner.model)
    assert sorted(blocks) == [0, 2, 3] and all(b.experts is fused_fp8_experts for b in blocks.values())
    calls = []

    def recorded(*args: torch.Tensor) -> torch.Tensor:
        out = fused_fp8_experts(*args)
        calls.append((args, out))
        return out

    for block in blocks.values():
        block.experts = recorded
    prompt = random_prompt(5, 20)
    runner.execute([SeqChunk(prompt, 0, {w: list(range(4)) for w in kv.window_sizes}, True)])
    assert len(calls) == 3
    for args, out in calls:
        want = w8a8_experts(*args)
        assert (out - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())
