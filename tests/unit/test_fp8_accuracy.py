"""What FP8 weights cost on trained models (pdserve_bench/fp8_accuracy.py): perplexity on held-back text
within 1% of float32 with `quantization: fp8` (the CPU's path: the weights' rounding) and with the GPU's
numerics emulated (activations rounded to FP8 per token too), top-1 agreement with float32, and the
greedy agreement over 64 tokens reported. Models: `builtin:tiny-story` and a small Qwen3 trained for
about a minute (cached in the pdserve cache dir, built once per machine)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve_bench.fp8_accuracy import measure
from pdserve_bench.trained_qwen3 import trained_qwen3
from server.models.builtin import resolve_model


@pytest.fixture(scope="session")
def trained_qwen3_dir() -> Path:
    return trained_qwen3()


@pytest.mark.parametrize("name", ["tiny-story", "trained-qwen3"])
def test_fp8_perplexity_within_one_percent_of_float32(trained_qwen3_dir: Path, name: str, record_property) -> None:
    model_dir = resolve_model("builtin:tiny-story") if name == "tiny-story" else trained_qwen3_dir
    figures = measure(model_dir, name, num_prompts=2)  # 2 greedy runs a variant (was 4): only reported
    record_property("fp8_accuracy", figures)
    print(json.dumps(figures))  # the greedy agreement is reported, not judged (tiny models part quickly)
    assert figures["held_out_tokens"] > 5000
    for variant in ("fp8", "fp8_w8a8"):
        assert abs(figures["perplexity_vs_float32"][variant]) < 0.01, (variant, figures)
    assert figures["top1_agreement"]["fp8"] > 0.9
    assert figures["top1_agreement"]["fp8_w8a8"] > 0.85
    assert set(figures["greedy_64"]["fp8"]) == {"identical", "mean_tokens_before_first_difference"}
