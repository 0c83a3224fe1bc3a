"""Block-scaled FP8 checkpoints (`weight_block_size: [128, 128]`, fp8/weight.py `from_block_checkpoint`), float32
on a CPU: the weights and their fusing, the GPU's block-scaled GEMM (interpreted), refusals that
name the tensor or the key, and MoE models (experts, shared expert, dense layers, DeepSeek's latent
attention) served from such checkpoints with transformers' tokens of the dequantized weights
(tests/fp8_checkpoints.py `write_fp8(..., per="block")` and `write_dequantized`)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from server.models.fp8.weight import (
    FP8,
    Fp8Weight,
    cat_rows,
    dequantized_linear,
    from_block_checkpoint,
    quantize_weight,
    stack_experts,
    w8a8_linear,
)


def _block_weight(n: int, k: int, seed: int) -> tuple[Fp8Weight, torch.Tensor]:
    """A block-scaled weight and the float32 weight it stands for (its blocks' scales differ)."""
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(FP8)
    scale = torch.rand(-(-n // 128), -(-k // 128), generator=gen) + 0.01
    full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    return from_block_checkpoint(q, scale, (128, 128), "w"), q.float() * full


def test_block_weight_dequantizes_each_block_with_its_scale() -> None:
    w, want = _block_weight(300, 200, 1)  # partial blocks at both edges
    assert w.block_k == 128 and w.scale.shape == (300, 2)
    assert torch.equal(w.dequantize(), want)
    x = torch.randn(5, 200, generator=torch.Generator().manual_seed(2))
    assert torch.equal(dequantized_linear(x, w, None), torch.nn.functional.linear(x, want))
    near = w8a8_linear(x, w, None)  # the activations rounded to e4m3, the weight exact
    assert (near - x @ want.t()).abs().max() < 0.1 * (x @ want.t()).abs().max()


def test_wrong_block_scale_shapes_are_refused_naming_the_weight() -> None:
    q = torch.zeros(300, 200).to(FP8)
    with pytest.raises(ValueError, match="weight 'w': a block scale of shape \\(3, 1\\) for a weight of shape "
                                         "\\(300, 200\\) in blocks of \\[128, 128\\]: want \\(3, 2\\)"):
        from_block_checkpoint(q, torch.ones(3, 1), (128, 128), "w")


def test_block_weights_fuse_and_stack_row_by_row_exactly() -> None:
    """q|k|v of 64-row parts (not whole blocks of rows) and a per-channel part among block ones."""
    parts = [_block_weight(n, 256, seed)[0] for seed, n in enumerate((128, 64, 64))]
    channel = quantize_weight(torch.randn(64, 256, generator=torch.Generator().manual_seed(9)))
    fused = cat_rows([*parts, channel])
    assert isinstance(fused, Fp8Weight) and fused.block_k == 128 and fused.scale.shape == (320, 2)
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in (*parts, channel)]))
    stacked = stack_experts([parts[1], parts[2], channel])
    assert isinstance(stacked, Fp8Weight) and stacked.scale.shape == (3, 64, 2)
    assert torch.equal(stacked.expert(2).dequantize(), channel.dequantize())


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CUDA machine: tests/gpu/test_fp8_blocks_cuda.py")
@pytest.mark.parametrize("rows", [1, 20, 70])
def test_gpu_linear_runs_the_block_scaled_gemm(rows: int) -> None:
    """The GPU's linear of a block-scaled weight is its own kernel (interpreted here): the dequantized
    weight's product to float32 summation order, partial row, column and block tiles included; the
    warm-up has nothing to time for it."""
    from server.models.fp8.linear import Fp8Linears

    w, want = _block_weight(300, 200, 4)
    gen = torch.Generator().manual_seed(5)
    x, bias = torch.randn(rows, 200, generator=gen), torch.randn(300, generator=gen)
    linears = Fp8Linears()
    got, ref = linears.linear(x, w, bias), torch.nn.functional.linear(x, want, bias)
    assert got.shape == (rows, 300) and got.dtype == torch.float32
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()
    linears.choose([w], [None], torch.float32)
    assert not linears.chosen


def test_block_checkpoints_are_refused_with_tensor_parallelism(tmp_path: Path) -> None:
    from fp8_checkpoints import write_fp8

    from server.models.builtin import resolve_model
    from server.models.model_spec import load_spec
    from server.models.parallel.shard import load_shard, plan_for

    fp8_dir = write_fp8(resolve_model("builtin:tiny-qwen3-moe"), tmp_path / "fp8", per="block",
                        scale_name="weight_scale_inv")
    spec = load_spec(fp8_dir)
    with pytest.raises(ValueError, match=f"model {fp8_dir}: config.json: quantization_config.weight_block_size: "
                                         "\\[128, 128\\]: block-scaled FP8 checkpoints are served on one GPU only"):
        load_shard(spec, plan_for(spec, 0, 2), torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("model", ["builtin:tiny-qwen3-moe", "builtin:tiny-deepseek-v3", "builtin:tiny-mixtral"])
def test_block_checkpoint_serves_transformers_tokens_of_its_weights(model: str, tmp_path: Path) -> None:
    import engine_harness as eh
    import hf_reference
    from fp8_checkpoints import write_dequantized, write_fp8
    from prompts import random_prompt

    from server.models.builtin import resolve_model
    from server.models.moe import MoEBlock

    fp8_dir = write_fp8(resolve_model(model), tmp_path / "fp8", per="block", scale_name="weight_scale_inv")
    reference = write_dequantized(fp8_dir, tmp_path / "ref")
    core = eh.make_core(str(fp8_dir))
    layers = core.runner.model.layers
    block = next(layer.mlp for layer in layers if isinstance(layer.mlp, MoEBlock))
    assert isinstance(block.gate_up, Fp8Weight) and block.gate_up.block_k == 128
    dense = [layer.mlp for layer in layers if not isinstance(layer.mlp, MoEBlock)]
    assert all(isinstance(m.down, Fp8Weight) and m.down.scale.shape[-1] == 2 for m in dense)  # K = 256: 2 blocks
    prompts = [random_prompt(90 + i, n) for i, n in enumerate([8, 35])]
    got = [r.token_ids for r in eh.generate(core, prompts, eh.greedy(12))]
    assert got == [hf_reference.hf_greedy_ignore_eos(reference, p, 12) for p in prompts]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CUDA machine: the kernels compile there")
def test_triton_runner_runs_block_scaled_experts_in_the_grouped_kernels(tmp_path: Path) -> None:
    """On the Triton path (interpreted) a block-scaled checkpoint's experts run the grouped kernels
    with their float8 weights widened and each block scaled (kernels/moe.py), and the step's logits
    are the torch runner's (to float32 rounding of the other kernels)."""
    pytest.importorskip("triton")
    from fp8_checkpoints import write_fp8
    from prompts import random_prompt

    from kvcache import KvCacheConfig, KVCacheManager
    from server.models.builtin import resolve_model
    from server.models.kernels.moe import fused_experts
    from server.models.model_spec import load_spec
    from server.models.moe import moe_blocks
    from server.models.runner import ModelRunner, SeqChunk

    fp8_dir = write_fp8(resolve_model("builtin:tiny-qwen3-moe"), tmp_path / "fp8", per="block",
                        scale_name="weight_scale_inv")
    logits = {}
    for kernels in ("torch", "triton"):
        kv = KVCacheManager(KvCacheConfig(max_tokens=1024, tokens_per_block=16),
                            load_spec(fp8_dir).cache_layout(256, torch.float32, "cpu"))
        runner = ModelRunner(fp8_dir, kv, dtype=torch.float32, device=torch.device("cpu"), max_num_tokens=128,
                             max_batch_size=2, kernels=kernels, cuda_graphs=False)
        if kernels == "triton":
            assert all(b.experts is fused_experts for b in moe_blocks(runner.model).values())
        prompt = random_prompt(6, 20)
        logits[kernels] = runner.execute([SeqChunk(prompt, 0, {w: list(range(4)) for w in kv.window_sizes}, True)])
    assert (logits["triton"] - logits["torch"]).abs().max().item() < 1e-3 * logits["torch"].abs().max().item()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CUDA machine: tests/gpu/test_fp8_blocks_cuda.py")
@pytest.mark.parametrize("tokens", [1, 20, 70])
def test_grouped_kernels_run_block_scaled_experts_as_their_dequantized_weights(tokens: int) -> None:
    """The grouped expert kernels with block-scaled float8 weights (interpreted) compute what the torch
    experts compute with the dequantized weights, partial column blocks (hidden 200, intermediate 192)
    and experts no token routed to included."""
    from server.models.kernels.moe import fused_experts
    from server.models.moe.experts import dense_experts

    experts, hidden, inter, top_k = 4, 200, 192, 2
    gate_up = stack_experts([_block_weight(2 * inter, hidden, 10 + e)[0] for e in range(experts)])
    down = stack_experts([_block_weight(hidden, inter, 20 + e)[0] for e in range(experts)])
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=gen) * 1e-3
    ids = torch.randint(0, experts - 1, (tokens, top_k), generator=gen)  # the last expert: never routed to
    weights = torch.rand(tokens, top_k, generator=gen)
    got = fused_experts(x, gate_up, down, weights, ids)
    ref = dense_experts(x, gate_up.dequantize(), down.dequantize(), weights, ids)
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CUDA machine: tests/gpu covers it")
@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_per_pair_tiles_run_block_scaled_experts_as_their_dequantized_weights(tokens: int) -> None:
    """The per-pair tiles (kernels/moe.py PER_PAIR_TILES; a K step longer than the 128-column scale block
    cut to it) with block-scaled float8 experts, interpreted, on 3 of 4 experts (pairs of the fourth:
    id E, weight 0) against the torch experts of the dequantized weights; partial column blocks."""
    from server.models.kernels.moe import PER_PAIR_TILES, fused_experts
    from server.models.moe.experts import dense_experts

    experts, hidden, inter, top_k = 4, 200, 192, 2
    gate_up = stack_experts([_block_weight(2 * inter, hidden, 10 + e)[0] for e in range(experts - 1)])
    down = stack_experts([_block_weight(hidden, inter, 20 + e)[0] for e in range(experts - 1)])
    gen = torch.Generator().manual_seed(40 + tokens)
    x = torch.randn(tokens, hidden, generator=gen) * 1e-3
    ids = torch.rand(tokens, experts, generator=gen).topk(top_k, dim=1).indices  # id 3: no expert here
    ids[-1, 0] = 3
    weights = torch.rand(tokens, top_k, generator=gen) * (ids < 3)
    ref = dense_experts(x, gate_up.dequantize(), down.dequantize(), weights, ids.clamp(max=2))
    assert ref.abs().max() > 0
    for tile in PER_PAIR_TILES:
        got = fused_experts(x, gate_up, down, weights, ids, tile)
        assert (got - ref).abs().max() <= 1e-5 * ref.abs().max(), tile
