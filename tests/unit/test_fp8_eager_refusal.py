"""An FP8 KV cache with `cuda_graphs: false` on the Triton kernels of a GPU is refused when the engine
is built (the server exits with this error before serving); every other combination is served."""

from __future__ import annotations

import pytest
import torch

from server.config.schema import server_config_from_dict
from server.engine_host.build import eager_fp8_cache_problem

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


def _cfg(**keys):
    return server_config_from_dict({"model": "builtin:tiny-llama", "kv_cache_config": {"dtype": "fp8"}, **keys})


def test_the_eager_triton_path_over_an_fp8_cache_is_refused_on_cuda_naming_the_keys():
    problem = eager_fp8_cache_problem(_cfg(cuda_graphs=False, kernels="triton"), CUDA, latent=False)
    assert problem is not None and "kv_cache_config.dtype: fp8" in problem and "cuda_graphs: false" in problem


@pytest.mark.parametrize("keys, device, latent", [
    ({"cuda_graphs": True, "kernels": "triton"}, CUDA, False),  # graphs: served
    ({"cuda_graphs": False, "kernels": "torch"}, CUDA, False),  # the portable path
    ({"cuda_graphs": False, "kernels": "auto"}, CPU, False),  # a CPU runs torch
    ({"cuda_graphs": False, "kernels": "triton"}, CUDA, True),  # a latent cache: torch attention
], ids=["graphs", "torch-kernels", "cpu", "latent"])
def test_the_other_combinations_are_served(keys, device, latent):
    assert eager_fp8_cache_problem(_cfg(**keys), device, latent) is None


def test_a_cache_in_the_models_dtype_is_served_eagerly():
    cfg = server_config_from_dict({"model": "builtin:tiny-llama", "cuda_graphs": False, "kernels": "triton"})
    assert eager_fp8_cache_problem(cfg, CUDA, latent=False) is None
