"""Tensor-parallel model shards (gloo, real processes) against one rank and transformers, float32.

Each case runs a prompt through `ModelRunner`s with `RankShard`s in `size` spawned processes (rank
0 here is a child too; tests/tp_ranks.py), prefilled in two chunks then decoded greedily; every rank gets the whole
logits (gathered), so each picks the same token without a broadcast. Cases: TP=2 on tiny-llama, on
the sliding window model and on Qwen2 (qkv biases, sliding layers); TP=4 on tiny-llama (4 ranks, 2 kv heads:
each kv head replicated on two ranks) and on a tied Llama with every bias and a vocabulary that 4
does not divide (padded rows). Mixture-of-experts models split each expert's intermediate dimension:
TP=2 on tiny-qwen2-moe (a gated shared expert) and tiny-qwen3-moe (dense and sparse layers), TP=4
on tiny-mixtral saved in transformers 5's stacked layout (`experts.gate_up_proj`); and the same with
expert parallelism (a name ending in ":ep": whole experts spread over the ranks, 4 or 2 each; ":a2a": the same, their
tokens sent to them by all-to-all).
DeepSeek's latent attention splits its heads (q, kv_b and o) and keeps the latent whole on every
rank: TP=2 on tiny-deepseek-v2, TP=4 (one head a rank) on tiny-deepseek-v3. GLM-4.5 (q/k/v biases and
norms per head, RoPE on half of each head, DeepSeek-V3's gate and shared expert): TP=2 on tiny-glm4-moe.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import hf_reference
import pytest
import torch
from safetensors.torch import load_file, save_file
from tp_ranks import NEW_TOKENS, TRITON_NEW_TOKENS, greedy, make_runner, run_ranks, tp_prompt

from server.models.builtin import build_tiny_model, materialize_builtin
from server.models.model_spec import load_spec
from server.models.parallel.plan import ShardPlan, kv_head_range, tp_problem


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp-models")
    dirs = {
        "tiny-qwen3-swa": materialize_builtin("tiny-qwen3-swa"),
        "qwen2-bias-sliding": build_tiny_model(root / "qwen2", "qwen2", use_sliding_window=True,
                                               sliding_window=24, max_window_layers=2),
        "tiny-llama": materialize_builtin("tiny-llama"),
        "llama-tied-bias-odd-vocab": build_tiny_model(root / "llama-odd", "llama", tie_word_embeddings=True,
                                                      attention_bias=True, mlp_bias=True, vocab_size=498),
        "tiny-qwen2-moe": materialize_builtin("tiny-qwen2-moe"),
        "tiny-qwen3-moe": materialize_builtin("tiny-qwen3-moe"),
        "mixtral-stacked": _stacked_experts(materialize_builtin("tiny-mixtral"), root / "mixtral-stacked"),
        "tiny-deepseek-v2": materialize_builtin("tiny-deepseek-v2"),
        "tiny-deepseek-v3": materialize_builtin("tiny-deepseek-v3"),
        "tiny-glm4-moe": materialize_builtin("tiny-glm4-moe"),
    }
    for name in ("tiny-qwen2-moe:ep", "mixtral-stacked:ep", "tiny-qwen2-moe:a2a", "tiny-deepseek-v3:a2a"):
        dirs[name] = dirs[name.split(":")[0]]
    return dirs


def _stacked_experts(model_dir: Path, out: Path) -> Path:
    """A copy of a Mixtral checkpoint with its experts in transformers 5's stacked layout
    (`model.layers.{i}.mlp.experts.gate_up_proj` [E, 2I, hidden], `...down_proj` [E, hidden, I])."""
    shutil.copytree(model_dir, out)
    tensors = load_file(out / "model.safetensors")
    for i in range(4):
        old = f"model.layers.{i}.block_sparse_moe."
        experts = range(8)
        gate_up = [torch.cat([tensors.pop(f"{old}experts.{e}.w1.weight"), tensors.pop(f"{old}experts.{e}.w3.weight")])
                   for e in experts]
        down = [tensors.pop(f"{old}experts.{e}.w2.weight") for e in experts]
        new = f"model.layers.{i}.mlp."
        tensors[new + "experts.gate_up_proj"] = torch.stack(gate_up)
        tensors[new + "experts.down_proj"] = torch.stack(down)
        tensors[new + "gate.weight"] = tensors.pop(old + "gate.weight")
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.parametrize(("size", "names"), [
    (2, ("tiny-qwen3-swa", "qwen2-bias-sliding", "tiny-llama", "tiny-qwen2-moe", "tiny-qwen3-moe",
         "tiny-qwen2-moe:ep", "tiny-qwen2-moe:a2a", "tiny-deepseek-v2", "tiny-glm4-moe")),
    (4, ("tiny-llama", "llama-tied-bias-odd-vocab", "mixtral-stacked", "mixtral-stacked:ep", "tiny-deepseek-v3",
         "tiny-deepseek-v3:a2a"))])
def test_tp_greedy_matches_one_rank_and_transformers(model_dirs: dict[str, Path], tmp_path: Path,
                                                     size: int, names: tuple[str, ...]) -> None:
    ranks = run_ranks(size, {n: model_dirs[n] for n in names}, tmp_path)
    for name in names:
        runner, kv = make_runner(model_dirs[name], None)
        ids = tp_prompt(runner.spec.vocab_size)
        one_rank, one_rank_logits = greedy(runner, kv, ids)
        assert one_rank == hf_reference.hf_greedy(model_dirs[name], ids, NEW_TOKENS), name
        for rank, result in enumerate(ranks):
            tokens, logits = result[name]
            assert tokens == one_rank, (name, rank)
            assert (torch.tensor(logits) - torch.tensor(one_rank_logits)).abs().max().item() < 1e-4, (name, rank)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CUDA machine: tests/gpu/test_tp_cuda.py")
def test_tp2_triton_kernels_after_warm_up_match_transformers(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """The Triton path (interpreted on the CPU): each rank warms up with its own heads, in step."""
    pytest.importorskip("triton")
    name = "tiny-qwen3-swa"
    ranks = run_ranks(2, {name: model_dirs[name]}, tmp_path, kernels="triton", new_tokens=TRITON_NEW_TOKENS)
    ids = tp_prompt(load_spec(model_dirs[name]).vocab_size)
    want = hf_reference.hf_greedy(model_dirs[name], ids, TRITON_NEW_TOKENS)
    assert [r[name][0] for r in ranks] == [want, want]


def test_shard_plan_heads_replication_and_vocab() -> None:
    assert tp_problem(4, 2, 2) is None and tp_problem(4, 2, 4) is None
    assert "does not divide the model's 4 attention heads" in tp_problem(4, 2, 3)
    assert "neither divides the model's 6 kv heads" in tp_problem(8, 6, 4)
    assert [kv_head_range(2, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [kv_head_range(8, 2, r) for r in range(2)] == [(0, 4), (4, 8)]
    plan = ShardPlan(rank=3, size=4, num_heads=8, num_kv_heads=2, intermediate_size=256, vocab_size=498)
    assert (plan.heads, plan.kv_heads, plan.share(plan.intermediate_size), plan.vocab) == \
        ((6, 8), (1, 2), (192, 256), (375, 500))
    with pytest.raises(ValueError, match="tensor_parallel_size: 3 does not divide"):
        ShardPlan(rank=0, size=3, num_heads=4, num_kv_heads=2, intermediate_size=256, vocab_size=512)
    with pytest.raises(ValueError, match="expert_parallel_size: 3 does not divide the model's 8 routed experts"):
        ShardPlan(rank=0, size=3, num_heads=6, num_kv_heads=3, intermediate_size=255, vocab_size=512,
                  num_experts=8, expert_parallel=True)
    with pytest.raises(ValueError, match="tensor_parallel_size: 4 does not divide the model's moe_intermediate_size"):
        ShardPlan(rank=0, size=4, num_heads=4, num_kv_heads=2, intermediate_size=256, vocab_size=512,
                  other_ffn_sizes=(("moe_intermediate_size", 66),))


def test_tp2_fp8_moe_checkpoint_matches_one_rank_and_its_dequantized_model(tmp_path: Path) -> None:
    """A per-channel FP8 checkpoint of tiny-qwen2-moe (experts, gated shared expert, attention in FP8):
    each expert's slice takes its rows' scales (gate/up) or all of them (down), split or whole
    (expert parallelism); the ranks' tokens are one rank's and transformers' of the dequantized weights."""
    from fp8_checkpoints import write_dequantized, write_fp8

    fp8 = write_fp8(materialize_builtin("tiny-qwen2-moe"), tmp_path / "fp8", scale_name="weight_scale_inv")
    reference = write_dequantized(fp8, tmp_path / "ref")
    ranks = run_ranks(2, {"fp8": fp8, "fp8:ep": fp8}, tmp_path)
    runner, kv = make_runner(fp8, None)
    ids = tp_prompt(runner.spec.vocab_size)
    one_rank, one_rank_logits = greedy(runner, kv, ids)
    assert one_rank == hf_reference.hf_greedy(reference, ids, NEW_TOKENS)
    for rank, result in enumerate(ranks):
        for name in ("fp8", "fp8:ep"):
            tokens, logits = result[name]
            assert tokens == one_rank, (name, rank)
            assert (torch.tensor(logits) - torch.tensor(one_rank_logits)).abs().max().item() < 1e-4, (name, rank)
