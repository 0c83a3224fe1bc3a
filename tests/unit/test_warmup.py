"""The start-up warm-up (server/models/warmup.py): its steps cover every compile-time variant the
scheduler's step shapes can ask of the Triton kernels, every index part a kernel points at is
16-byte aligned whatever the step (so alignment never makes a new variant), and the warm-up leaves
no trace in the KV manager: outputs after it stay token-exact (Triton path, TRITON_INTERPRET)."""

from __future__ import annotations

import os
import random

import hf_reference
import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the triton package (test extra)")

from kvcache import KvCacheConfig, KVCacheManager  # noqa: E402
from server.models.attention import SeqLayout, StepLayout  # noqa: E402
from server.models.builtin import resolve_model  # noqa: E402
from server.models.kernels.attention import decode_splits  # noqa: E402
from server.models.model_spec import load_spec  # noqa: E402
from server.models.runner import ModelRunner, SeqChunk  # noqa: E402
from server.models.warmup import warm_steps  # noqa: E402

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CUDA machine: tests/gpu covers the compiled kernels")


@pytest.mark.parametrize("max_batch, max_tokens", [(4, 256), (64, 8192), (256, 8192), (64, 100)])
def test_warm_steps_cover_every_decode_split_count(max_batch: int, max_tokens: int) -> None:
    steps = warm_steps(max_batch, max_tokens, 32, 8, 132)
    assert {decode_splits(b, 8, 132) for b in range(1, max_batch + 1)} == \
        {decode_splits(s.decode_rows, 8, 132) for s in steps}
    for s in steps:
        assert 1 <= s.decode_rows <= max_batch
        assert s.decode_rows + s.prompt_tokens + s.chunk_tokens <= max_tokens
    largest = steps[0]
    assert largest.decode_rows + largest.prompt_tokens + largest.chunk_tokens == max_tokens


def _runner(max_batch: int = 4, tokens: int = 256) -> tuple[ModelRunner, KVCacheManager]:
    model_dir = resolve_model("builtin:tiny-qwen3-swa")  # two window groups: two plans per step
    layout = load_spec(model_dir).cache_layout(256, torch.float32, "cpu")
    kv = KVCacheManager(KvCacheConfig(max_tokens=2048, tokens_per_block=16), layout)
    return ModelRunner(model_dir, kv, dtype=torch.float32, device=torch.device("cpu"), max_num_tokens=tokens,
                       max_batch_size=max_batch, kernels="triton", cuda_graphs=False, max_seq_len=256), kv


def _index_tensors(meta) -> list[torch.Tensor]:
    out = []
    for window in meta.values():
        out += [window.slot, window.offset]
        if window.decode is not None:
            out += [window.decode.block_table, window.decode.seq_lens, window.decode.lo]
        if window.paged is not None:
            out += [window.paged.block_table, *window.paged.tiles, window.paged.lo_seq]
    return out


@interpreted
def test_every_index_part_of_a_plan_is_16_byte_aligned() -> None:
    runner, _ = _runner()
    rng = random.Random(3)
    for _ in range(40):
        seqs = [SeqLayout(rng.randint(0, 150), 1, {}) for _ in range(rng.randint(0, 3))]
        num_decode = len(seqs)
        seqs += [SeqLayout(rng.choice([0, rng.randint(1, 100)]), rng.randint(2, 40), {})
                 for _ in range(rng.randint(0 if num_decode else 1, 2))]
        tables = {w: list(range(16)) for w in runner.kv.window_sizes}
        seqs = [SeqLayout(s.num_past, s.num_new, tables) for s in seqs]
        layout = StepLayout(seqs, num_decode)
        meta = runner.attention.plan(layout, torch.zeros(layout.num_tokens, dtype=torch.int64))
        for tensor in _index_tensors(meta):
            assert tensor.dtype == torch.int32 and tensor.storage_offset() % 4 == 0


@interpreted
def test_warm_up_leaves_the_cache_untouched_and_outputs_exact() -> None:
    runner, kv = _runner()
    before = kv.stats()
    assert runner.warm_up() > 0
    assert kv.stats() == before  # no block allocated, cached or moved
    prompt = [5 + (j * 29) % 500 for j in range(70)]
    kv.admit("r", prompt, num_tokens=len(prompt) + 4)
    tables = {w: kv.slot_table("r", w) for w in kv.window_sizes}
    out: list[int] = []
    for _ in range(4):
        past = len(prompt) + len(out) - 1
        chunk = SeqChunk([out[-1]], past, tables, True) if out else SeqChunk(prompt, 0, tables, True)
        logits = runner.execute([chunk])
        logits[:, list(runner.spec.eos_token_ids)] = float("-inf")
        out.append(int(logits.argmax(-1)))
    assert out == hf_reference.hf_greedy(runner.spec.model_dir, prompt, 4)
