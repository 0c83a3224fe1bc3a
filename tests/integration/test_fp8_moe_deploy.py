"""FP8 experts in real deployments (`pdserve launch` with `quantization: fp8`, CPU, float32): a MoE
model's routed experts, shared experts and dense linears quantized at load answer transformers' texts
of the float32 model those FP8 weights stand for (tests/fp8_checkpoints.py `write_quantized_at_load`),
aggregated (Mixtral) and disaggregated (DeepSeek-V3: latent attention, a shared expert, a dense first
layer). Those texts differ from the float model's, so the comparison sees the FP8 weights. And a
block-scaled FP8 checkpoint (`weight_block_size: [128, 128]`, as DeepSeek-V3 and Qwen3-FP8 ship) of a
MoE model answers transformers' texts of its dequantized weights (`write_dequantized`)."""

from __future__ import annotations

import deploy_harness as dh
import hf_reference
import pytest
from fp8_checkpoints import write_dequantized, write_fp8, write_quantized_at_load
from transformers import AutoTokenizer

from server.models.builtin import resolve_model

PROMPTS = ["The quick brown fox", "When an exception is raised,", "Topic: sailing. Now answer briefly:"]
NEW = 16


def _hf_texts(model_dir, tokenizer) -> list[str]:
    return [tokenizer.decode(hf_reference.hf_greedy_ignore_eos(model_dir, tokenizer.encode(p), NEW),
                             skip_special_tokens=True) for p in PROMPTS]


@pytest.mark.parametrize(("model", "config"), [("builtin:tiny-mixtral", "aggregated.yaml"),
                                               ("builtin:tiny-deepseek-v3", "disagg.yaml")])
def test_fp8_moe_deployment_answers_the_texts_of_its_fp8_weights(model: str, config: str, tmp_path_factory) -> None:
    model_dir = resolve_model(model)
    reference = write_quantized_at_load(model_dir, tmp_path_factory.mktemp("ref") / "model")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    want = _hf_texts(reference, tokenizer)
    assert want != _hf_texts(model_dir, tokenizer)
    overrides = {"model": model, "quantization": "fp8", "dtype": "float32"}
    assert _served_texts(config, tmp_path_factory.mktemp("deploy"), overrides) == want


def _served_texts(config: str, tmp_path, overrides: dict) -> list[str]:
    with dh.launched(config, tmp_path, overrides) as dep:
        texts = dh.greedy_texts(dep.url, PROMPTS, NEW)
        servers = [p for p in dep.log_dir.glob("*.log") if "launcher" not in p.name and "router" not in p.name]
        assert servers and all("linear weights fp8" in p.read_text(errors="replace") for p in servers), dep.logs()
    return texts


def test_block_scaled_fp8_moe_checkpoint_answers_the_texts_of_its_weights(tmp_path_factory) -> None:
    source = resolve_model("builtin:tiny-qwen3-moe")
    root = tmp_path_factory.mktemp("block")
    fp8_dir = write_fp8(source, root / "fp8", per="block", scale_name="weight_scale_inv")
    tokenizer = AutoTokenizer.from_pretrained(source)
    want = _hf_texts(write_dequantized(fp8_dir, root / "ref"), tokenizer)
    texts = _served_texts("aggregated.yaml", tmp_path_factory.mktemp("deploy"),
                          {"model": str(fp8_dir), "dtype": "float32"})
    assert texts == want
