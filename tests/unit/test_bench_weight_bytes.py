"""The b1 roofline's numerator (scripts/bench_gpu.py `weight_bytes`): every weight a decode step reads,
reached through the layers' own objects (dense MLPs, experts, latent attention), equals the checkpoint's
bytes less the embedding table, of which a step reads one row."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from server.models.builtin import materialize_builtin

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import bench_gpu  # noqa: E402


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3-moe", "tiny-deepseek-v2"])
def test_weight_bytes_are_the_checkpoint_less_the_embedding(name: str) -> None:
    model_dir = materialize_builtin(name)
    args = argparse.Namespace(max_num_tokens=64, kernels="torch", no_graphs=True, dtype="float32")
    core, _ = bench_gpu.make_core(model_dir, args, {"max_tokens": 256})
    checkpoint, embed = 0, 0
    for path in model_dir.glob("*.safetensors"):
        with safe_open(path, "pt") as tensors:
            for key in tensors.keys():
                size = tensors.get_slice(key).get_shape()
                count = 1
                for dim in size:
                    count *= dim
                checkpoint += count * 4  # float32 as served
                embed += count * 4 if key.endswith("embed_tokens.weight") else 0
    assert bench_gpu.weight_bytes(core) == checkpoint - embed
