"""Tensor parallelism on CUDA (NCCL): skipped without at least two GPUs (four for the TP=4 case).

Real servers through `pdserve launch`, float32, Triton kernels with decode CUDA graphs (the NCCL
all-reduce and the logits' all-gather are captured in the graphs): an aggregated TP=2 server's
greedy text equals a TP=1 server's and transformers' on both tiny models; context TP=2 -> generation
TP=1 and TP=1 -> TP=2 (CUDA pools: heads cut out on the GPU, staged through pinned memory) equal
the aggregated text through a host-offload replay; TP=4 (kv heads replicated) equals TP=1. The
servers run CUDA's defaults (engine process, async scheduling) unless a test says otherwise.

    python -m pytest -q tests/gpu/test_tp_cuda.py
"""

from __future__ import annotations

import deploy_harness as dh
import hf_reference
import pytest
import torch
from transformers import AutoTokenizer
from waiting import wait_until

from server.models.builtin import resolve_model

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")

FILLER = "Each rank holds some of the heads, and the answer must not change. "
PROMPTS = ["The quick brown fox", "Topic: rivers. " + FILLER * 4 + "Now answer briefly:", "abc " * 120]
CUDA = {"device": "cuda", "dtype": "float32", "kernels": "triton", "cuda_graphs": True, "max_seq_len": 1024,
        "max_num_tokens": 1024, "max_batch_size": 8, "kv_cache_config": {"tokens_per_block": 32, "max_tokens": 4096}}


def _texts(url: str) -> list[str]:
    return dh.greedy_texts(url, PROMPTS, 24, 300)


def _aggregated(tmp_path, model: str, tp: int, extra: dict | None = None) -> list[str]:
    folder = tmp_path / f"{model}-{tp}-{len(list(tmp_path.iterdir()))}"
    folder.mkdir()
    overrides = {**CUDA, "model": f"builtin:{model}", "tensor_parallel_size": tp, **(extra or {})}
    with dh.launched("aggregated.yaml", folder, overrides) as dep:
        return _texts(dep.url)


def _hf(model: str) -> list[str]:
    model_dir = resolve_model(f"builtin:{model}")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [tokenizer.decode(hf_reference.hf_greedy_ignore_eos(model_dir, tokenizer.encode(p), 24, device="cuda"),
                             skip_special_tokens=True) for p in PROMPTS]


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3-swa"])
def test_tp2_server_equals_tp1_and_transformers(tmp_path, model) -> None:
    assert _aggregated(tmp_path, model, 2) == _aggregated(tmp_path, model, 1) == _hf(model)


def test_tp2_engine_process_with_async_scheduling_equals_the_engine_thread(tmp_path) -> None:
    """CUDA's defaults: the engine in a process of its own (rank 0, which starts rank 1) and async
    scheduling (each decode row's token broadcast from rank 0's device over NCCL, never the host)."""
    want = _hf("tiny-llama")
    assert _aggregated(tmp_path, "tiny-llama", 2, {"engine_process": True, "async_scheduling": True}) == want
    assert _aggregated(tmp_path, "tiny-llama", 2, {"engine_process": False, "async_scheduling": False}) == want


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 GPUs")
def test_tp4_with_replicated_kv_heads_equals_tp1(tmp_path) -> None:
    assert _aggregated(tmp_path, "tiny-llama", 4) == _aggregated(tmp_path, "tiny-llama", 1)


@pytest.mark.parametrize(("ctx_tp", "gen_tp"), [(2, 1), (1, 2)])
def test_heterogeneous_pair_through_host_offload_equals_aggregated(tmp_path, ctx_tp, gen_tp) -> None:
    want = _aggregated(tmp_path, "tiny-qwen3-swa", 1)
    overrides = {**CUDA, "model": "builtin:tiny-qwen3-swa",
                 "context_servers": {"tensor_parallel_size": ctx_tp,
                                     "kv_cache_config": {"max_tokens": 512, "host_cache_size": 64 << 20}},
                 "generation_servers": {"tensor_parallel_size": gen_tp}}
    (tmp_path / "pair").mkdir()
    with dh.launched("disagg_host_offload.yaml", tmp_path / "pair", overrides) as pair:
        for _ in range(3):  # the replays onboard from the host tier on every context rank
            assert _texts(pair.url) == want
        ctx, gen = pair.context_urls[0], pair.generation_urls[0]
        assert pair.metric(gen, "pdserve_kv_transfer_bytes_total") > 0
        wait_until(lambda: pair.metric(ctx, "pdserve_kv_cache_blocks", 'state="in_use"') == 0, 30,
                   what="context blocks released")
