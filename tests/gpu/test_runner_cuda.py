"""The runner on CUDA, with the portable torch kernels and with the Triton kernels (eager, and decode
replayed as CUDA graphs): float32 token-exact against transformers, graphs equal to eager, bfloat16
agreement with transformers bfloat16 counted over 64 tokens, and no host synchronisation inside the
forward. The mixture-of-experts models run their experts densely (every expert on every token: the
torch path) or as two grouped GEMMs (the Triton path), both graph-safe. DeepSeek-V2/V3 (latent
attention, MoE layers): the torch MLA on the torch path and for the Triton path's prefill, the latent
decode kernel (kernels/latent.py) for its decode, eager and in graphs. Skipped without CUDA."""

from __future__ import annotations

from pathlib import Path

import hf_reference
import pytest
import torch
from prompts import stride_prompt
from runner_harness import no_host_syncs

from kvcache import KvCacheConfig, KVCacheManager
from server.models.builtin import materialize_builtin
from server.models.model_spec import load_spec
from server.models.runner import ModelRunner, SeqChunk, resolve_device, resolve_dtype

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

MOE_MODELS = ["tiny-mixtral", "tiny-qwen2-moe", "tiny-qwen3-moe", "tiny-glm4-moe"]  # GLM: partial rotary in rope_write
MLA_MODELS = ["tiny-deepseek-v2", "tiny-deepseek-v3"]
MODELS = ["tiny-llama", "tiny-qwen3-swa", *MOE_MODELS, *MLA_MODELS]
PROMPT_LENS = [9, 40, 100, 150]  # the longer ones exceed tiny-qwen3-swa's 64-token window
NEW_TOKENS = 32
BF16_TOKENS = 64
# (kernels, CUDA graphs): the portable path, Triton eager, Triton with decode graphs
VARIANTS = [("torch", False), ("triton", False), ("triton", True)]
CASES = [(n, k, g) for n in MODELS for k, g in VARIANTS]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cuda")
    return {name: materialize_builtin(name, root=root) for name in MODELS}


def _prompts() -> list[list[int]]:
    return [stride_prompt(n) for n in PROMPT_LENS]


def _batched_greedy(model_dir: Path, dtype: torch.dtype, kernels: str = "torch", graphs: bool = False,
                    new_tokens: int = NEW_TOKENS) -> tuple[list[list[int]], ModelRunner]:
    """Prefill every prompt in one step, then decode all of them together (EOS masked like HF)."""
    device = resolve_device("auto")
    layout = load_spec(model_dir).cache_layout(1024, dtype, device)
    kv = KVCacheManager(KvCacheConfig(max_tokens=8192, tokens_per_block=32), layout)
    runner = ModelRunner(model_dir, kv, dtype=dtype, device=device, max_num_tokens=1024, max_batch_size=8,
                         kernels=kernels, cuda_graphs=graphs, max_seq_len=1024)
    runner.warm_up()
    assert (runner.graphs is not None and bool(runner.graphs.graphs)) == graphs
    prompts = _prompts()
    for i, p in enumerate(prompts):
        kv.admit(f"r{i}", p, num_tokens=len(p) + new_tokens)
    outs: list[list[int]] = [[] for _ in prompts]
    for _ in range(new_tokens):
        chunks = []
        for i, p in enumerate(prompts):
            done = len(p) + len(outs[i]) - (1 if outs[i] else len(p))
            tokens = [outs[i][-1]] if outs[i] else p
            tables = {w: kv.slot_table(f"r{i}", w) for w in kv.window_sizes}
            chunks.append(SeqChunk(tokens, done, tables, need_logits=True))
        logits = runner.execute(chunks)
        logits[:, list(runner.spec.eos_token_ids)] = float("-inf")
        for i, token in enumerate(logits.argmax(-1).tolist()):
            outs[i].append(token)
    return outs, runner


@pytest.mark.parametrize("name, kernels, graphs", CASES)
def test_float32_on_cuda_matches_hf_token_for_token(model_dirs: dict[str, Path], name: str, kernels: str,
                                                    graphs: bool) -> None:
    outs, _ = _batched_greedy(model_dirs[name], torch.float32, kernels, graphs)
    for prompt, out in zip(_prompts(), outs, strict=True):
        assert out == hf_reference.hf_greedy(model_dirs[name], prompt, NEW_TOKENS, device="cuda")


@pytest.mark.parametrize("name", MODELS)
def test_graphs_equal_eager(model_dirs: dict[str, Path], name: str) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        eager, _ = _batched_greedy(model_dirs[name], dtype, "triton", False)
        graphed, _ = _batched_greedy(model_dirs[name], dtype, "triton", True)
        assert graphed == eager, dtype


@pytest.mark.parametrize("name, kernels, graphs", CASES)
def test_bfloat16_agreement_with_hf_bfloat16(model_dirs: dict[str, Path], name: str, kernels: str,
                                             graphs: bool) -> None:
    """bf16 kernels round differently from transformers' (reduction orders, exp), and on a random
    tiny model near-tied logits then pick other tokens: the prefill logits must agree to bf16
    precision; greedy agreement over 64 tokens is reported."""
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    outs, runner = _batched_greedy(model_dirs[name], torch.bfloat16, kernels, graphs, BF16_TOKENS)
    matched = []
    for i, (prompt, out) in enumerate(zip(_prompts(), outs, strict=True)):
        ref = hf_reference.hf_greedy(model_dirs[name], prompt, BF16_TOKENS, dtype=torch.bfloat16,
                                     device="cuda")
        same = [a == b for a, b in zip(out, ref, strict=True)]
        matched.append(same.index(False) if False in same else len(same))
        ours = _prefill_logits(runner, f"check{i}", prompt)
        theirs = hf_reference.hf_logits(model_dirs[name], prompt, dtype=torch.bfloat16, device="cuda")[-1]
        error = ((ours - theirs).norm() / theirs.norm()).item()
        # bf16 rounding through 4 layers: 2.1e-2 seen on the H200 (Triton path); a wrong kernel is O(1).
        # A MoE model turns a rounding difference into another expert where two gate scores nearly tie:
        # up to 0.165 seen on the H100 (2026-12-06, Triton path, the same with the torch experts in
        # place of the fused ones: attention's rounding, not the experts'; torch path <= 0.027)
        # DeepSeek's layers 1-3 are MoE layers too, on both paths (its gate in float32, as transformers'),
        # and GLM-4.5's, with the same gate (0.184 seen on the torch path, H100, 2026-12-07)
        float32_gate = name in MLA_MODELS or name == "tiny-glm4-moe"
        bound = 0.25 if (name in MOE_MODELS and kernels == "triton") or float32_gate else 5e-2
        assert error < bound, f"prompt {i}: prefill logits differ from HF bf16 by {error:.3g} (relative L2)"
    print(f"\n{name} {kernels} graphs={graphs} bf16: greedy tokens equal to HF bf16 before the first "
          f"divergence: {matched} of {BF16_TOKENS}")


def _prefill_logits(runner: ModelRunner, request_id: str, prompt: list[int]) -> torch.Tensor:
    runner.kv.admit(request_id, prompt, num_tokens=len(prompt))
    tables = {w: runner.kv.slot_table(request_id, w) for w in runner.kv.window_sizes}
    logits = runner.execute([SeqChunk(prompt, 0, tables, True)])[0].float().cpu()
    runner.kv.release(request_id)
    return logits


@pytest.mark.parametrize("name", MOE_MODELS)
def test_fused_experts_equal_the_dense_torch_experts_in_bfloat16(model_dirs: dict[str, Path], name: str) -> None:
    """The Triton path's grouped GEMMs (server/models/kernels/moe.py) against the torch experts in the
    same runner (same attention kernels), bf16 prefill logits: the experts' own rounding only."""
    from server.models.moe import moe_blocks
    from server.models.moe.experts import dense_experts

    _, runner = _batched_greedy(model_dirs[name], torch.bfloat16, "triton", False, new_tokens=1)
    for i, prompt in enumerate(_prompts()):
        fused = _prefill_logits(runner, f"fused{i}", prompt)
        blocks = moe_blocks(runner.model).values()
        kernel = next(iter(blocks)).experts
        for block in blocks:
            block.experts = dense_experts
        dense = _prefill_logits(runner, f"dense{i}", prompt)
        for block in blocks:
            block.experts = kernel
        assert kernel is not dense_experts
        error = ((fused - dense).norm() / dense.norm()).item()
        assert error < 1e-2, f"prompt {i}: fused experts differ from the torch experts by {error:.3g}"


@pytest.mark.parametrize("name", ["tiny-qwen3-swa", "tiny-qwen3-moe", "tiny-deepseek-v3"])
@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_forward_has_no_host_synchronisation(model_dirs: dict[str, Path], kernels: str, name: str) -> None:
    _, runner = _batched_greedy(model_dirs[name], torch.bfloat16, kernels)
    tables = {w: runner.kv.slot_table("r3", w) for w in runner.kv.window_sizes}
    # a decode token of r3 and a prefill chunk rewriting r3's first 20 positions, in one step
    chunks = [SeqChunk([7], 150 + NEW_TOKENS - 1, tables, True),
              SeqChunk(list(range(5, 25)), 0, tables, True)]
    inputs = runner.prepare(chunks)  # host -> device copies happen here, outside the checked region
    with no_host_syncs():
        logits = runner.forward(inputs)
    assert logits.shape == (2, 512) and logits.is_cuda
