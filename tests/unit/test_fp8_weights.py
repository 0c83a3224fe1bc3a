"""FP8 weights on the CPU: the quantization math, the checkpoint formats users download (Hugging Face
`quant_method: fp8` and compressed-tensors, made here from tiny models), and `quantization: fp8` at load.

A CPU server multiplies FP8 weights dequantized to float32, so an FP8 model must compute exactly what
its dequantized checkpoint computes in float32 (tests/fp8_checkpoints.py writes both): logits equal to
the float runner's, and greedy tokens equal to transformers' on the dequantized checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import engine_harness as eh
import hf_reference
import pytest
import torch
from fp8_checkpoints import write_dequantized, write_fp8
from prompts import random_prompt
from safetensors.torch import load_file, save_file

from kvcache import KvCacheConfig, KVCacheManager
from server.models.builtin import materialize_builtin
from server.models.fp8.checkpoint import checkpoint_quant
from server.models.fp8.weight import FP8, Fp8Weight, cat_rows, from_checkpoint, quantize_weight
from server.models.model_spec import load_spec, with_quantization
from server.models.parallel.shard import load_shard, plan_for
from server.models.runner import ModelRunner, SeqChunk, load_weights

TPB = 16
CASES = {  # name: (built-in model, layout, per, static, scale tensor name); the last two carry KV cache scales
    "llama-hf-tensor-static": ("tiny-llama", "hf-fp8", "tensor", True, "weight_scale"),
    "llama-hf-channel-scale-inv": ("tiny-llama", "hf-fp8", "channel", False, "weight_scale_inv"),
    "qwen3-ct-channel": ("tiny-qwen3-swa", "compressed-tensors", "channel", False, "weight_scale"),
    "qwen3-ct-tensor-static": ("tiny-qwen3-swa", "compressed-tensors", "tensor", True, "weight_scale"),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """name -> (the FP8 checkpoint, its float32 dequantized reference)."""
    root = tmp_path_factory.mktemp("fp8")
    out = {}
    for name, (model, layout, per, static, scale) in CASES.items():
        fp8 = write_fp8(materialize_builtin(model), root / name, layout, per, static, scale, model == "tiny-qwen3-swa")
        out[name] = (fp8, write_dequantized(fp8, root / f"{name}-ref"))
    return out


def make_runner(model_dir: Path, quantization: str | None = None) -> ModelRunner:
    kv = KVCacheManager(KvCacheConfig(max_tokens=2048, tokens_per_block=TPB),
                        load_spec(model_dir).cache_layout(512, torch.float32, "cpu"))
    return ModelRunner(model_dir, kv, dtype=torch.float32, device=torch.device("cpu"), max_num_tokens=256,
                       max_batch_size=4, kernels="torch", quantization=quantization)


def prefill_logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    tables = {w: list(range(-(-len(ids) // TPB))) for w in runner.kv.window_sizes}
    return runner.execute([SeqChunk(ids, 0, tables, True, num_logits=len(ids))])


def test_quantize_weight_rounds_each_row_to_its_own_scale() -> None:
    torch.manual_seed(0)
    w = torch.randn(24, 64) * torch.logspace(-3, 2, 24)[:, None]
    w[5] = 0.0
    q = quantize_weight(w)
    assert q.qweight.dtype == FP8 and q.scale.shape == (24,)
    assert torch.equal(q.scale, w.abs().amax(1).clamp_min(1e-12) / 448)
    assert torch.equal(q.qweight.float().abs().amax(1)[torch.arange(24) != 5], torch.full((23,), 448.0))
    deq = q.dequantize()
    # e4m3 keeps 3 mantissa bits: within half a step (2^-4 relative), or 2^-10 of the row scale below 2^-6
    bound = torch.maximum(w.abs() * 2**-4, q.scale[:, None] * 2**-10)
    assert ((deq - w).abs() <= bound * (1 + 1e-6)).all()
    assert torch.equal(deq[5], torch.zeros(64))


def test_cat_rows_keeps_each_rows_scale_and_the_largest_static_input_scale() -> None:
    a, b = quantize_weight(torch.randn(8, 16)), quantize_weight(torch.randn(4, 16) * 10)
    fused = cat_rows([a, b])
    assert torch.equal(fused.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    assert fused.input_scale is None
    s1, s2 = torch.tensor([0.5]), torch.tensor([2.0])
    fused = cat_rows([Fp8Weight(a.qweight, a.scale, s1), Fp8Weight(b.qweight, b.scale, s2)])
    assert torch.equal(fused.input_scale, s2)
    mixed = cat_rows([a, torch.ones(4, 16, dtype=torch.bfloat16)])  # a checkpoint that left one part in float
    assert mixed.dtype == torch.bfloat16 and torch.equal(mixed[:8], a.dequantize(torch.bfloat16))


def test_checkpoint_scales_per_tensor_and_per_channel_only() -> None:
    q = torch.zeros(6, 32, dtype=FP8)
    assert torch.equal(from_checkpoint(q, torch.tensor(0.5), None, "w").scale, torch.full((6,), 0.5))
    assert torch.equal(from_checkpoint(q, torch.arange(6.0)[:, None], None, "w").scale, torch.arange(6.0))
    with pytest.raises(ValueError, match="'w': an FP8 scale of shape \\(3, 1\\).*not block-wise"):
        from_checkpoint(q, torch.ones(3, 1), None, "w")
    with pytest.raises(ValueError, match="shape \\(6, 2\\)"):
        from_checkpoint(q, torch.ones(6, 2), None, "w")
    with pytest.raises(ValueError, match="a float8_e4m3fn matrix"):
        from_checkpoint(q.to(torch.float8_e5m2), torch.tensor(1.0), None, "w")


@pytest.mark.parametrize(("config", "message"), [
    ({"quant_method": "fp8", "weight_block_size": [64, 128]},
     "quantization_config.weight_block_size: \\[64, 128\\]: only \\[128, 128\\] blocks are supported"),
    ({"quant_method": "fp8", "weight_block_size": 128},
     "quantization_config.weight_block_size: 128: only \\[128, 128\\] blocks are supported"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"},
     "quantization_config.activation_scheme: 'static': block-wise FP8 weights are supported with 'dynamic'"),
    ({"quant_method": "fp8", "activation_scheme": "per-token"}, "quantization_config.activation_scheme: 'per-token'"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "quantization_config.fmt: 'e5m2'"),
    ({"quant_method": "awq"}, "quantization_config.quant_method: 'awq' is not supported"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {
        "weights": {"num_bits": 8, "type": "float", "strategy": "block"}}}},
     "quantization_config.config_groups.g.weights.strategy: 'block'"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {
        "weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}}},
     "quantization_config.config_groups.g.weights: num_bits 8, type 'int': only 8-bit float"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}},
     "quantization_config.format: 'pack-quantized'"),
])
def test_unsupported_checkpoints_are_refused_naming_the_key(config: dict, message: str) -> None:
    with pytest.raises(ValueError, match=f"model /m: config.json: {message}"):
        checkpoint_quant({"quantization_config": config}, Path("/m"))


def test_supported_schemes() -> None:
    assert checkpoint_quant({}, Path("/m")) is None
    hf = checkpoint_quant({"quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}}, Path("/m"))
    assert (hf.method, hf.static_activations) == ("fp8", True)
    group = {"weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True},
             "input_activations": None}
    ct = checkpoint_quant({"quantization_config": {"quant_method": "compressed-tensors",
                                                   "config_groups": {"g": group}}}, Path("/m"))
    assert (ct.method, ct.static_activations) == ("compressed-tensors", False)


@pytest.mark.parametrize("name", list(CASES))
def test_fp8_checkpoint_logits_equal_its_dequantized_float32_model(checkpoints, name: str) -> None:
    fp8, ref = checkpoints[name]
    runner = make_runner(fp8)
    layer = runner.model.layers[0]
    assert all(isinstance(w, Fp8Weight) for w in (layer.qkv, layer.o, layer.mlp.gate_up, layer.mlp.down))
    assert isinstance(runner.model.lm_head, torch.Tensor) and runner.model.lm_head.dtype == torch.float32
    static = CASES[name][3]
    assert (layer.qkv.input_scale is not None) == static and (layer.mlp.down.input_scale is not None) == static
    ids = random_prompt(3, 70)
    got, want = prefill_logits(runner, ids), prefill_logits(make_runner(ref), ids)
    assert torch.allclose(got, want, rtol=0, atol=1e-5), (got - want).abs().max()


@pytest.mark.parametrize("name", ["llama-hf-tensor-static", "qwen3-ct-channel"])
def test_fp8_checkpoint_serves_transformers_tokens_of_its_dequantized_model(checkpoints, name: str) -> None:
    fp8, ref = checkpoints[name]
    core = eh.make_core(str(fp8))
    prompts = [random_prompt(10 + i, n) for i, n in enumerate([7, 40, 90])]  # 90: past the 64-token window
    results = eh.generate(core, prompts, eh.greedy(24))
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == hf_reference.hf_greedy(ref, prompt, 24)


def test_quantization_fp8_at_load(tmp_path: Path) -> None:
    """A float checkpoint's linears quantized per output channel as they load: exactly the model whose
    weights are quantize-then-dequantize of the float ones; the embedding, lm_head and norms untouched."""
    src = materialize_builtin("tiny-qwen3-swa")
    runner = make_runner(src, "fp8")
    tensors = load_file(str(src / "model.safetensors"))
    ref = {n: quantize_weight(t).dequantize() if n.endswith("proj.weight") else t for n, t in tensors.items()}
    (tmp_path / "ref").mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (tmp_path / "ref" / f.name).write_bytes(f.read_bytes())
    save_file(ref, str(tmp_path / "ref" / "model.safetensors"))
    assert torch.equal(runner.model.embed, tensors["model.embed_tokens.weight"])
    assert torch.equal(runner.model.lm_head, tensors["lm_head.weight"])
    assert runner.model.layers[1].o.scale.shape == (128,)
    ids = random_prompt(4, 80)
    assert torch.allclose(prefill_logits(runner, ids), prefill_logits(make_runner(tmp_path / "ref"), ids),
                          rtol=0, atol=1e-5)


def test_fingerprints_tell_fp8_weights_apart() -> None:
    spec = load_spec(materialize_builtin("tiny-llama"))
    fp8 = with_quantization(spec, "fp8")
    assert fp8.fingerprint != spec.fingerprint and fp8.quantization == "fp8"
    assert with_quantization(spec, None) is spec and with_quantization(fp8, "fp8") is fp8


def test_static_checkpoint_without_input_scale_is_refused(checkpoints, tmp_path: Path) -> None:
    fp8, _ = checkpoints["llama-hf-tensor-static"]
    tensors = load_file(str(fp8 / "model.safetensors"))
    del tensors["model.layers.2.mlp.down_proj.input_scale"]
    for f in fp8.iterdir():
        if f.name != "model.safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="activations are static .* 'model.layers.2.mlp.down_proj.input_scale' is "
                                         "missing"):
        load_weights(load_spec(tmp_path), torch.float32, torch.device("cpu"))


def test_block_wise_config_with_per_channel_scales_is_refused_at_load(checkpoints, tmp_path: Path) -> None:
    """A config that says [128, 128] blocks over per-channel scales: the first FP8 weight's scale is named."""
    fp8, _ = checkpoints["llama-hf-channel-scale-inv"]
    for f in fp8.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [128, 128]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert load_spec(tmp_path).checkpoint_quant.block == (128, 128)
    with pytest.raises(ValueError, match=f"model {tmp_path}: weight 'model.layers.0.*weight': a block scale of "
                                         "shape \\(\\d+,\\) for a weight of shape"):
        load_weights(load_spec(tmp_path), torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("name", ["llama-hf-channel-scale-inv", "qwen3-ct-tensor-static"])
def test_tensor_parallel_shards_take_their_rows_scales(checkpoints, name: str) -> None:
    """Column-parallel weights (q/k/v, gate/up) take their rows' per-channel scales; row-parallel ones
    (o, down) keep every output row's; per-tensor and input scales are whole."""
    fp8, _ = checkpoints[name]
    spec = load_spec(fp8)
    whole = load_weights(spec, torch.float32, torch.device("cpu"))
    for rank in range(2):
        plan = plan_for(spec, rank, 2)
        part = load_shard(spec, plan, torch.float32, torch.device("cpu"))
        d, (h0, h1), (f0, f1) = spec.head_dim, plan.heads, plan.share(plan.intermediate_size)
        q, gate = "model.layers.1.self_attn.q_proj.weight", "model.layers.1.mlp.gate_proj.weight"
        o, down = "model.layers.1.self_attn.o_proj.weight", "model.layers.1.mlp.down_proj.weight"
        assert torch.equal(part[q].dequantize(), whole[q].dequantize()[h0 * d:h1 * d])
        assert torch.equal(part[gate].dequantize(), whole[gate].dequantize()[f0:f1])
        assert torch.equal(part[o].dequantize(), whole[o].dequantize()[:, h0 * d:h1 * d])
        assert torch.equal(part[down].dequantize(), whole[down].dequantize()[:, f0:f1])
        assert (part[down].input_scale is None) == (whole[down].input_scale is None)
