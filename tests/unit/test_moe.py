"""MoE blocks (server/models/moe/) against transformers' own modules on random weights, float32.

Each case builds transformers' sparse block of a family (MixtralSparseMoeBlock, Qwen2MoeSparseMoeBlock,
Qwen3MoeSparseMoeBlock, DeepseekV2Moe, DeepseekV3MoE, Glm4MoeMoE) from a small config, fills it from a
seeded generator (the e_score_correction_bias of DeepSeek-V3 and GLM-4.5 too, so it changes the
choice), and runs ours,
built by `parse_moe` + `build_moe` from the module's tensors under their HF names, in both layouts
a checkpoint may use: one tensor per expert (as published checkpoints are) and transformers 5's
stacked `experts.gate_up_proj`. Also: which layers are sparse, the graph-safe dense path against the
grouped one, the device-side expert load, and every refusal naming its key.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from server.models.moe import MoEBlock, build_moe, parse_moe
from server.models.moe.experts import dense_experts, grouped_experts
from server.models.ops import TorchOps

HIDDEN, TOKENS = 64, 40
SHAPE = dict(hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=100)

V2_MOE = "deepseek_v2.modeling_deepseek_v2.DeepseekV2Moe"
# name -> (config class, architecture, the block's module name in its modeling file, config keys)
CASES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", "mixtral.modeling_mixtral.MixtralSparseMoeBlock",
                dict(num_local_experts=8, num_experts_per_tok=2)),
    "qwen2-moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", "qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
                  dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=48, norm_topk_prob=False)),
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", "qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
                  dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=True)),
    "deepseek-v2-greedy": ("DeepseekV2Config", "DeepseekV2ForCausalLM", V2_MOE,
                           dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                n_shared_experts=2, routed_scaling_factor=1.5, topk_method="greedy")),
    "deepseek-v2-groups": ("DeepseekV2Config", "DeepseekV2ForCausalLM", V2_MOE,
                           dict(n_routed_experts=16, num_experts_per_tok=3, moe_intermediate_size=32,
                                n_shared_experts=1, routed_scaling_factor=16.0,
                                topk_method="group_limited_greedy", n_group=4, topk_group=2)),
    "deepseek-v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", "deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE",
                    dict(n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=32, n_shared_experts=1,
                         routed_scaling_factor=2.5, n_group=4, topk_group=2, norm_topk_prob=True)),
    "deepseek-v3-unnormalised": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                                 "deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE",
                                 dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                      n_shared_experts=2, routed_scaling_factor=1.0, n_group=1, topk_group=1,
                                      norm_topk_prob=False)),
    "glm4-moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", "glm4_moe.modeling_glm4_moe.Glm4MoeMoE",
                 dict(n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=32, n_shared_experts=1,
                      routed_scaling_factor=2.5, n_group=4, topk_group=2, norm_topk_prob=True)),
}


class Tensors:
    """The `WeightSource` of a dict of HF-named tensors."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def take(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def has(self, name: str) -> bool:
        return name in self.tensors


def _hf_block(case: str) -> tuple[torch.nn.Module, object, str]:
    config_cls, arch, module, keys = CASES[case]
    cfg = getattr(transformers, config_cls)(**SHAPE, **keys)
    path, cls = module.rsplit(".", 1)
    modeling = __import__(f"transformers.models.{path}", fromlist=[cls])
    block = getattr(modeling, cls)(cfg).eval()
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for _, tensor in sorted([*block.named_parameters(), *block.named_buffers()]):
            tensor.copy_(torch.randn(tensor.shape, generator=gen) * (0.1 if tensor.dim() == 1 else 0.3))
    return block, cfg, arch


def _per_expert(state: dict[str, torch.Tensor], prefix: str, names: tuple[str, str, str]) -> dict[str, torch.Tensor]:
    """transformers 5's stacked experts as one tensor per expert and projection (a published checkpoint)."""
    out = {k: v for k, v in state.items() if not k.startswith(prefix + "experts.")}
    gate_up, down = state[prefix + "experts.gate_up_proj"], state[prefix + "experts.down_proj"]
    size = gate_up.shape[1] // 2
    for e in range(gate_up.shape[0]):
        out[f"{prefix}experts.{e}.{names[0]}.weight"] = gate_up[e, :size]
        out[f"{prefix}experts.{e}.{names[1]}.weight"] = gate_up[e, size:]
        out[f"{prefix}experts.{e}.{names[2]}.weight"] = down[e]
    return out


def _ours(case: str, layout: str) -> tuple[MoEBlock, torch.nn.Module]:
    hf, cfg, arch = _hf_block(case)
    spec = parse_moe(cfg.to_dict(), cfg, arch, Path("tiny"))
    layer = spec.sparse_layers.index(True)
    hf_prefix = f"model.layers.{layer}.mlp."
    state = {hf_prefix + k: v for k, v in hf.state_dict().items()}
    if layout == "per-expert":
        state = _per_expert(state, hf_prefix, (spec.names.gate, spec.names.up, spec.names.down))
        block = f"model.layers.{layer}.{spec.names.block}"
        state = {block + k.removeprefix(hf_prefix): v for k, v in state.items()}
    return build_moe(spec, Tensors(state), layer), hf


@pytest.mark.parametrize("layout", ["per-expert", "stacked"])
@pytest.mark.parametrize("case", list(CASES))
def test_block_matches_transformers_module(case: str, layout: str) -> None:
    ours, hf = _ours(case, layout)
    x = torch.randn(1, TOKENS, HIDDEN, generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        want = hf(x)
        want = want[0] if isinstance(want, tuple) else want
        got = ours(x[0], TorchOps(1e-6))
    # float32 rounding of outputs up to a few hundred (DeepSeek's routed_scaling_factor): relative to the largest
    assert (got - want[0]).abs().max().item() < 1e-6 * max(1.0, want.abs().max().item())
    assert int(ours.load.sum()) == TOKENS * ours.spec.top_k


@pytest.mark.parametrize("case", ["mixtral", "deepseek-v3"])
def test_dense_path_equals_grouped_path(case: str) -> None:
    """The graph-safe path (CUDA's: every expert on every token, zero weight where not routed) computes
    what the grouped one does."""
    block, _ = _ours(case, "stacked")
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(3))
    from server.models.moe import route

    weights, ids = route(block.spec, x, block.gate, block.correction)
    grouped = grouped_experts(x, block.gate_up, block.down, weights, ids)
    dense = dense_experts(x, block.gate_up, block.down, weights, ids)
    assert (grouped - dense).abs().max().item() < 1e-6 * max(1.0, grouped.abs().max().item())  # float32 rounding
    assert grouped.abs().max().item() > 0.1


def test_load_counts_each_expert_on_the_device() -> None:
    block, _ = _ours("mixtral", "stacked")
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(4))
    from server.models.moe import route

    _, ids = route(block.spec, x, block.gate)
    block(x, TorchOps(1e-6))
    block(x[:5], TorchOps(1e-6))
    want = torch.bincount(torch.cat([ids.flatten(), ids[:5].flatten()]), minlength=8)
    assert block.load.tolist() == want.tolist()
    assert min(want.tolist()) > 0  # every expert gets tokens: routing matters in the comparisons above


@pytest.mark.parametrize(("config_cls", "arch", "layer_cls", "keys"), [
    ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", "qwen2_moe.modeling_qwen2_moe.Qwen2MoeDecoderLayer",
     dict(num_experts=4, decoder_sparse_step=2, mlp_only_layers=[3], num_hidden_layers=6)),
    ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", "qwen3_moe.modeling_qwen3_moe.Qwen3MoeDecoderLayer",
     dict(num_experts=4, decoder_sparse_step=1, mlp_only_layers=[0, 2], num_hidden_layers=5)),
    ("DeepseekV3Config", "DeepseekV3ForCausalLM", "deepseek_v3.modeling_deepseek_v3.DeepseekV3DecoderLayer",
     dict(n_routed_experts=4, first_k_dense_replace=2, n_group=2, topk_group=1, num_experts_per_tok=2,
          num_hidden_layers=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8,
          v_head_dim=8, head_dim=8)),
    ("Glm4MoeConfig", "Glm4MoeForCausalLM", "glm4_moe.modeling_glm4_moe.Glm4MoeDecoderLayer",
     dict(n_routed_experts=4, first_k_dense_replace=3, n_group=2, topk_group=1, num_experts_per_tok=2,
          num_hidden_layers=5)),
])
def test_sparse_layers_are_transformers(config_cls, arch, layer_cls, keys) -> None:
    cfg = getattr(transformers, config_cls)(**{**SHAPE, "num_experts_per_tok": 2, "moe_intermediate_size": 8, **keys})
    path, cls = layer_cls.rsplit(".", 1)
    modeling = __import__(f"transformers.models.{path}", fromlist=[cls])
    want = tuple(hasattr(getattr(modeling, cls)(cfg, i).mlp, "gate") for i in range(cfg.num_hidden_layers))
    assert parse_moe(cfg.to_dict(), cfg, arch, Path("tiny")).sparse_layers == want
    assert True in want and False in want


REFUSALS = [
    ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(scoring_func="softmax"), "scoring_func: 'softmax'"),
    ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(scoring_func="sigmoid"), "scoring_func: 'sigmoid'"),
    ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(topk_method="greedy"), "topk_method: 'greedy'"),
    ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(topk_method="noaux_tc"), "topk_method: 'noaux_tc'"),
    ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(norm_topk_prob=True), "norm_topk_prob: True"),
    ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(moe_layer_freq=2), "moe_layer_freq: 2"),
    ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(n_group=3), "n_group: 3"),
    ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(n_group=8, topk_group=1), "n_group: 8"),  # groups of 1 expert
    ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(scoring_func="softmax"), "scoring_func: 'softmax'"),
    ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(n_group=4, topk_group=5), "topk_group: 5"),
    ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(n_group=4, topk_group=1, num_experts_per_tok=3),
     "num_experts_per_tok: 3"),
    ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(use_sliding_window=True), "use_sliding_window: True"),
    ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(num_experts_per_tok=9), "num_experts_per_tok: 9"),
    ("MixtralConfig", "MixtralForCausalLM", dict(num_experts_per_tok=0), "num_experts_per_tok: 0"),
]


@pytest.mark.parametrize(("config_cls", "arch", "keys", "message"), REFUSALS)
def test_unsupported_keys_are_refused_by_name(config_cls, arch, keys, message) -> None:
    base = dict(n_routed_experts=8, num_experts=8, num_local_experts=8, num_experts_per_tok=2, moe_intermediate_size=8)
    cfg = getattr(transformers, config_cls)(**SHAPE, **{**base, **keys})
    raw = {**cfg.to_dict(), **keys}
    with pytest.raises(ValueError, match=f"config.json: {message}"):
        parse_moe(raw, cfg, arch, Path("tiny"))


TINY = {"tiny-mixtral": (True,) * 4, "tiny-qwen2-moe": (True,) * 4, "tiny-qwen3-moe": (True, False, True, True),
        "tiny-glm4-moe": (False, True, True, True)}


@pytest.mark.parametrize("name", list(TINY))
def test_tiny_models_route_every_token_through_several_experts(name: str) -> None:
    """The built-in MoE models: 8 experts, 2 per token, and a prompt spreads over all of them in every
    sparse layer (so a wrong gate changes the output); tiny-qwen3-moe's layer 1 is dense, and
    tiny-glm4-moe's layer 0."""
    import engine_harness as eh
    from prompts import random_prompt

    core = eh.make_core(f"builtin:{name}")
    spec = core.runner.spec.moe
    assert (spec.num_experts, spec.top_k, spec.sparse_layers) == (8, 2, TINY[name])
    eh.generate(core, [random_prompt(3, 60)], eh.greedy(4))
    blocks = [layer.mlp for layer in core.runner.model.layers if isinstance(layer.mlp, MoEBlock)]
    assert len(blocks) == sum(TINY[name])
    for block in blocks:
        load = block.load
        assert int(load.sum()) == (60 + 3) * 2 and int(load.min()) > 0, load


def test_fp8_is_accepted_for_moe_models(tmp_path: Path) -> None:
    """FP8 experts (tests/unit/test_moe_fp8.py): `quantization: fp8` and an FP8 checkpoint's config load."""
    import json
    import shutil

    from server.models.builtin import resolve_model
    from server.models.model_spec import load_spec, with_quantization

    model = resolve_model("builtin:tiny-qwen3-moe")
    assert with_quantization(load_spec(model), "fp8").quantization == "fp8"
    copy = shutil.copytree(model, tmp_path / "fp8")
    config = json.loads((copy / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (copy / "config.json").write_text(json.dumps(config))
    assert load_spec(copy).quantization == "fp8" and load_spec(copy).moe is not None


@pytest.mark.parametrize("tokens", [1, 5, 37])
def test_fused_triton_experts_equal_the_torch_path(tokens: int) -> None:
    """The two grouped GEMMs (server/models/kernels/moe.py; the Triton interpreter on a CPU) against
    the grouped torch path, for a decode row, a few rows and a prefill's worth of pairs."""
    pytest.importorskip("triton")
    from server.models.kernels.moe import align, fused_experts

    block, _ = _ours("qwen3-moe", "stacked")
    device = "cuda" if torch.cuda.is_available() else "cpu"  # compiled on a GPU, interpreted on a CPU
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens))
    from server.models.moe import route

    weights, ids = route(block.spec, x, block.gate)
    want = grouped_experts(x, block.gate_up, block.down, weights, ids)
    on = [t.to(device) for t in (x, block.gate_up, block.down, weights, ids)]
    got = fused_experts(*on).cpu()
    assert (got - want).abs().max().item() < 1e-5
    rows, tile_expert = (t.cpu() for t in align(on[4], 8, 16))
    real = rows[rows < ids.numel()]
    assert sorted(real.tolist()) == list(range(ids.numel()))  # every pair once
    experts = ids.flatten()[rows.clamp(max=ids.numel() - 1)].view(-1, 16)
    for tile, expert in enumerate(tile_expert.tolist()):  # each tile's real rows are its expert's
        live = rows.view(-1, 16)[tile] < ids.numel()
        assert expert >= 8 and not live.any() or (experts[tile][live] == expert).all()


@pytest.mark.parametrize("case", ["mixtral", "qwen2-moe", "qwen3-moe", "deepseek-v2-greedy",
                                  "deepseek-v3-unnormalised"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_top_k_is_the_torch_route_with_its_rounding_and_load(case: str, dtype: torch.dtype) -> None:
    """The Triton path's top-k in one kernel (kernels/route.py) against the block's torch routing: the same
    experts in the same order, weights normalised, scaled and (Qwen) rounded alike, the same load counts;
    a block whose routing it does not compute keeps torch. (Sigmoid scoring: DeepSeek-V3's spec with its
    correction bias switched off.)"""
    pytest.importorskip("triton")
    from dataclasses import replace

    from server.models.kernels import route as R

    block, _ = _ours(case, "stacked")
    spec = replace(block.spec, topk_method="greedy", score_correction_bias=False)
    assert R.fits(spec) and not R.fits(replace(spec, topk_method="noaux_tc"))
    assert not R.fits(replace(spec, score_correction_bias=True))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(7)).to(dtype)
    gate = block.gate.to(dtype)
    torch_block = MoEBlock(spec, gate, None, block.gate_up, block.down)
    want_w, want_ids = torch_block._route(x)
    load = torch.zeros(spec.num_experts, dtype=torch.int64, device=device)
    from server.models.moe.router import gate_logits

    logits = gate_logits(spec, x, gate).to(device)
    got_w, got_ids = R.fused_route(spec, logits, x.to(device), load)
    assert torch.equal(got_ids.cpu(), want_ids)
    # (on a GPU the kernel's exp and division are not torch's to the last bit: a weight rounded to bf16 may
    # land one step of bf16 away)
    rounded = spec.round_weights and dtype == torch.bfloat16 and device == "cuda"
    torch.testing.assert_close(got_w.cpu(), want_w, rtol=2**-8 if rounded else 1e-6, atol=1e-7)
    assert torch.equal(load.cpu(), torch_block.load)
    assert int(load.sum()) == TOKENS * spec.top_k and int((load > 0).sum()) > spec.top_k  # several experts


def test_fused_top_k_picks_distinct_held_experts_whatever_the_logits() -> None:
    """Rows of NaN and of -inf (a broken model's) still get top_k distinct ids below E and in-range load
    counts from the fused top-k: the expert kernels index weights by these ids. NaN ranks highest, as in
    torch.topk; finite logits before -inf ones. (60 experts: the kernel's lanes past E are padding.)"""
    pytest.importorskip("triton")
    from server.models.kernels import route as R

    device = "cuda" if torch.cuda.is_available() else "cpu"
    experts, top_k = 60, 6
    logits = torch.randn(4, experts)
    logits[0] = float("nan")
    logits[1] = float("-inf")
    logits[1, [7, 3]] = torch.tensor([2.0, 1.0])
    logits[2, [5, 50]] = float("nan")
    logits[3, :] = float("-inf")
    load = torch.zeros(experts, dtype=torch.int64, device=device)
    _, ids = R.fused_topk(logits.to(device), top_k, False, True, 1.0, 0.0, None, load)
    ids = ids.cpu()
    for row in ids.tolist():
        assert len(set(row)) == top_k and all(0 <= e < experts for e in row), row
    assert ids[1, :2].tolist() == [7, 3]
    assert set(ids[2, :2].tolist()) == {5, 50}
    assert torch.equal(load.cpu(), torch.bincount(ids.flatten(), minlength=experts))


@pytest.mark.parametrize(("tokens", "top_k", "experts", "block_m"), [(1, 8, 128, 16), (64, 8, 128, 16),
                                                                   (37, 3, 8, 32), (128, 8, 128, 64), (5, 6, 64, 16)])
def test_align_in_one_kernel_equals_the_torch_sort(tokens: int, top_k: int, experts: int, block_m: int,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """`align` up to ALIGN_PAIRS pairs (one Triton program; interpreted on a CPU) against its torch form:
    the same rows and tile experts, bit for bit, with pairs routed to no expert held here (id E) and the
    experts' loads uneven (a few experts take most pairs)."""
    pytest.importorskip("triton")
    from server.models.kernels import moe as kernels

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(tokens * experts)
    skew = torch.rand(tokens, experts + 1, generator=g) ** 4 * torch.linspace(1, 20, experts + 1)
    ids = skew.topk(top_k, dim=1).indices.to(device)  # values 0..E, the last column (E: not held) often taken
    assert tokens * top_k <= kernels.ALIGN_PAIRS
    rows, tile_expert = kernels.align(ids, experts, block_m)
    monkeypatch.setattr(kernels, "ALIGN_PAIRS", 0)  # the torch form
    want_rows, want_tiles = kernels.align(ids, experts, block_m)
    assert torch.equal(rows.cpu(), want_rows.cpu())
    assert torch.equal(tile_expert.cpu(), want_tiles.cpu())
    assert (want_tiles == experts).any() or tokens == 1


def test_every_candidate_tile_computes_the_torch_path_and_a_chosen_one_is_used() -> None:
    """What the warm-up may choose (kernels/moe.py CANDIDATES, timed on CUDA only) computes the
    grouped torch path for every tile (the Triton interpreter on a CPU); a chosen tile is what a
    step of its pair class then runs, and any other class keeps the default."""
    pytest.importorskip("triton")
    from server.models.kernels import moe as kernels
    from server.models.moe import route

    block, _ = _ours("qwen3-moe", "stacked")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(3))
    weights, ids = route(block.spec, x, block.gate)
    want = grouped_experts(x, block.gate_up, block.down, weights, ids)
    on = [t.to(device) for t in (x, block.gate_up, block.down, weights, ids)]
    for tile in sorted({t for tiles in kernels.CANDIDATES.values() for t in tiles}):
        assert (kernels.fused_experts(*on, tile=tile).cpu() - want).abs().max().item() < 1e-5, tile
    inter = block.down.shape[2]
    key = (block.gate_up.shape[0], inter, HIDDEN, block.gate_up.dtype, 64)
    try:
        kernels.CHOSEN[key] = (16, 128, 64, 4)
        assert kernels.tiles(block.gate_up, inter, 18) == (16, 128, 64, 4)  # 18 pairs: class 64
        assert kernels.tiles(block.gate_up, inter, 200) == kernels.tile_config(200)
    finally:
        kernels.CHOSEN.pop(key, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_per_pair_tiles_compute_the_torch_path_without_the_sort(tokens: int, dtype: torch.dtype,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Each per-pair tile (kernels/moe.py PER_PAIR_TILES, interpreted on a CPU) on the experts one of two
    expert-parallel ranks holds (top 3 of 8, pairs of the other rank's experts routed to id E, one token
    of several wholly elsewhere): the grouped torch path of the held experts, float32 to rounding and
    float16 to float16's rounding (as the grouped tile's float16 output is), the elsewhere-routed token's
    row exactly 0, and `align` never run. (bf16: tests/gpu/test_moe_per_pair_cuda.py; Triton's
    interpreter multiplies bf16 tiles wrongly, the grouped tiles' too.)"""
    pytest.importorskip("triton")
    from server.models.kernels import moe as kernels
    from server.models.moe import route
    from server.models.moe.block import _held

    block, _ = _ours("qwen3-moe", "stacked")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(20 + tokens))
    weights, ids = _held((0, 4), *route(block.spec, x, block.gate))
    if tokens > 1:
        ids[0], weights[0] = 4, 0.0  # token 0: no expert of this rank
    gate_up, down = block.gate_up[:4], block.down[:4]
    on = [t.to(device=device, dtype=dtype) for t in (x, gate_up, down)] + [t.to(device) for t in (weights, ids)]
    want = grouped_experts(*(t.to(dtype).float() for t in (x, gate_up, down)), weights, ids.clamp(max=3))
    grouped = kernels.fused_experts(*on, tile=kernels.tile_config(ids.numel())).cpu().float()
    monkeypatch.setattr(kernels, "align", None)  # a per-pair tile's step does not sort
    for tile in kernels.PER_PAIR_TILES:
        got = kernels.fused_experts(*on, tile=tile).cpu().float()
        assert tokens == 1 or torch.equal(got[0], torch.zeros(HIDDEN))
        if dtype == torch.float32:
            assert (got - want).abs().max().item() < 1e-5, tile
        else:  # gate, up, SiLU, h and each pair's output rounded to float16: as the grouped tile's
            assert (got - want).abs().max().item() < 4e-3 * want.abs().max().item(), tile
            assert (got - grouped).abs().max().item() < 2e-3 * want.abs().max().item(), tile
    assert (ids == 4).any() and (ids < 4).any() and want.abs().max().item() > 0.1


def test_expert_load_reaches_the_engine_figures_and_metrics() -> None:
    """What /metrics shows of a MoE model: per sparse layer, the tokens routed to each expert since
    start (each token top_k times), as the engine loop reads them (`engine_figures`)."""
    import engine_harness as eh
    from prompts import random_prompt

    from server.telemetry.metrics import EngineFigures, ServerMetrics
    from server.telemetry.relay import engine_figures

    core = eh.make_core("builtin:tiny-qwen3-moe")
    eh.generate(core, [random_prompt(5, 30), random_prompt(6, 12)], eh.greedy(5))
    tokens = engine_figures(core).expert_tokens
    assert sorted(tokens) == [0, 2, 3]  # layer 1 is dense
    # every prompt token and every generated token but the last went through the layers, twice each
    assert all(sum(counts) == (30 + 12 + 2 * 4) * 2 for counts in tokens.values())
    metrics = ServerMetrics()
    metrics.figures = lambda: EngineFigures(expert_tokens=tokens)
    text = metrics.render().decode()
    assert f'pdserve_moe_expert_tokens_total{{expert="7",layer="3"}} {float(tokens[3][7])}' in text


@pytest.mark.parametrize("path", ["grouped", "dense", "fused"])
def test_expert_parallel_shares_sum_to_the_whole(path: str) -> None:
    """Expert parallelism: each of 4 ranks runs only its 2 experts (pairs routed elsewhere get the id
    "no expert here" and weight 0); the ranks' outputs sum to all experts' output, on every path."""
    from server.models.moe import route
    from server.models.moe.block import _held

    if path == "fused":
        pytest.importorskip("triton")
        from server.models.kernels.moe import fused_experts as fn
    else:
        fn = grouped_experts if path == "grouped" else dense_experts
    block, _ = _ours("mixtral", "stacked")
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(8))
    weights, ids = route(block.spec, x, block.gate)
    whole = grouped_experts(x, block.gate_up, block.down, weights, ids)
    device = "cuda" if path == "fused" and torch.cuda.is_available() else "cpu"
    parts = []
    for rank in range(4):
        held = (2 * rank, 2 * rank + 2)
        w, i = _held(held, weights, ids)
        args = [t.to(device) for t in (x, block.gate_up[held[0]:held[1]], block.down[held[0]:held[1]], w, i)]
        parts.append(fn(*args).cpu())
    assert (sum(parts) - whole).abs().max().item() < 1e-5 * whole.abs().max().item()


def test_a_float32_router_stays_float32_in_a_bfloat16_model() -> None:
    """transformers keeps DeepSeek's and GLM-4.5's router weight and correction bias in float32 whatever
    the model dtype; so does the loader (the tiny model stores them in float32: bf16 would round them).
    The multi-token-prediction layer's tensors are not read at all."""
    from safetensors.torch import load_file

    from server.models.builtin import resolve_model
    from server.models.model_spec import load_spec
    from server.models.runner import load_weights

    spec = load_spec(resolve_model("builtin:tiny-glm4-moe"))
    tensors = load_weights(spec, torch.bfloat16, torch.device("cpu"))
    stored = load_file(spec.model_dir / "model.safetensors")
    for name in ("model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.e_score_correction_bias"):
        assert tensors[name].dtype == torch.float32 and torch.equal(tensors[name], stored[name]), name
        assert not torch.equal(stored[name].bfloat16().float(), stored[name])  # the rounding it avoids
    assert tensors["model.layers.0.mlp.gate_proj.weight"].dtype == torch.bfloat16
    assert any(n.startswith("model.layers.4.") for n in stored)
    assert not any(n.startswith("model.layers.4.") for n in tensors)
