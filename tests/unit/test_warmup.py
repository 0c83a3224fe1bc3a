"""The start-up warm-up (server/models/warmup.py): its steps cover every compile-time variant the
scheduler's step shapes can ask of the Triton kernels, every index part a kernel points at is
16-byte aligned whatever the step (so alignment never makes a new variant), and the warm-up leaves
no trace in the KV manager: outputs after it stay token-exact (Triton path, TRITON_INTERPRET).
The burst steps' plan exactly (which steps, their rows and tokens within the budget, replayed or
eager as `replay_plan` decides), and their chunks run through the runner (torch path, CPU)."""

from __future__ import annotations

import math
import os
import random

import hf_reference
import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the triton package (test extra)")

from kvcache import KvCacheConfig, KVCacheManager  # noqa: E402
from server.models.attention import SeqLayout, StepLayout  # noqa: E402
from server.models.builtin import resolve_model  # noqa: E402
from server.models.cuda_graphs import batch_buckets  # noqa: E402
from server.models.kernels.attention import decode_splits  # noqa: E402
from server.models.model_spec import load_spec  # noqa: E402
from server.models.runner import MIXED_ROWS, ModelRunner, SeqChunk, replay_plan  # noqa: E402
from server.models.warmup import STEPS_PER_DOUBLING, WarmStep, burst_steps, token_grid, warm_steps  # noqa: E402

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CUDA machine: tests/gpu covers the compiled kernels")


@pytest.mark.parametrize("max_batch, max_tokens", [(4, 256), (64, 8192), (256, 8192), (64, 100)])
def test_warm_steps_cover_every_decode_split_count(max_batch: int, max_tokens: int) -> None:
    steps = warm_steps(max_batch, max_tokens, 32, 8, 132)
    assert {decode_splits(b, 8, 132) for b in range(1, max_batch + 1)} == \
        {decode_splits(s.decode_rows, 8, 132) for s in steps}
    for s in steps:
        assert 1 <= s.decode_rows <= max_batch
        assert s.num_tokens <= max_tokens and len(s.prompts) <= 1 and not s.pending
    assert steps[0].num_tokens == max_tokens


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
        meta = runner.attention.plan(layout, torch.zeros(sum(s.num_new for s in seqs), dtype=torch.int64))
        for tensor in _index_tensors(meta):
            assert tensor.dtype == torch.int32 and tensor.storage_offset() % 4 == 0


@interpreted
def test_warm_up_leaves_the_cache_untouched_and_outputs_exact() -> None:
    runner, kv = _runner(tokens=96)  # a 96-token budget: the warm-up's full prefill step, smaller
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


def _buckets(max_batch: int, max_tokens: int) -> list[int]:
    """The runner's graph buckets (ModelRunner: rows up to max_batch_size + MIXED_ROWS)."""
    return batch_buckets(max(max_batch, min(max_tokens, max_batch + MIXED_ROWS)))


def test_burst_steps_of_the_8b_shape_exactly() -> None:
    """max_batch_size 64, max_num_tokens 8192: one replayed step per bucket (17), then 10 eager."""
    buckets = _buckets(64, 8192)
    assert buckets == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 288, 320]
    steps = burst_steps(64, 8192, buckets)
    replayed = [WarmStep(1, pending=True)] + [WarmStep(b - 2, (2,), pending=True) for b in buckets[1:9]]
    replayed += [WarmStep(63, (b - 63,), pending=True) for b in buckets[9:]]
    assert steps[:17] == replayed
    eager = [(1, (452,)), (1, (639,)), (1, (452, 453)), (2, (426,) * 3), (4, (451, 451, 451, 454)),
             (6, (425,) * 5 + (429,)), (9, (401,) * 8 + (404,)), (14, (364,) * 13 + (374,)),
             (21, (343,) * 20 + (360,)), (32, (255,) * 32)]
    assert steps[17:] == [WarmStep(d, prompts, pending=True) for d, prompts in eager]
    assert [s.num_tokens for s in steps[17:]] == [453, 640, 906, 1280, 1811, 2560, 3621, 5120, 7241, 8192]
    assert [len(_chunks(s)) for s in steps[17:]] == [2, 2, 3, 5, 8, 12, 18, 28, 42, 64]
    assert sum(s.num_tokens for s in steps[17:]) == 31824  # the eager prefill the warm-up adds


@pytest.mark.parametrize("max_batch, max_tokens", [(64, 8192), (48, 2048), (256, 8192), (8, 4096), (1, 512),
                                                   (4, 256), (64, 16384)])
def test_burst_steps_fit_the_budget_and_replay_where_serving_would(max_batch: int, max_tokens: int) -> None:
    buckets = _buckets(max_batch, max_tokens)
    steps = burst_steps(max_batch, max_tokens, buckets)
    grid = token_grid(buckets[-1], max_tokens)
    assert len(steps) == len(buckets) + len(grid)
    assert len(grid) <= max(0, math.ceil(STEPS_PER_DOUBLING * math.log2(max_tokens / buckets[-1])))
    for step in steps:
        assert step.pending and 1 <= len(_chunks(step)) <= max_batch and step.num_tokens <= max_tokens
        assert all(n >= 2 for n in step.prompts)  # fresh prompts, never a one-token (decode) row
    replayed, eager = steps[:len(buckets)], steps[len(buckets):]
    assert [s.num_tokens for s in replayed] == buckets  # each bucket's graph, exactly full
    assert all(replay_plan(_chunks(s), _fits(buckets, max_batch)) is not None for s in replayed)
    assert [s.num_tokens for s in eager] == grid
    assert all(replay_plan(_chunks(s), _fits(buckets, max_batch)) is None for s in eager)  # past every graph
    assert [len(_chunks(s)) for s in eager[-1:]] == [max_batch] * bool(grid)  # the last: a full batch


def _fits(buckets: list[int], max_batch: int):
    """`DecodeGraphs.fits` of graphs captured for `buckets`."""
    def fits(rows: int, logit_rows: int) -> bool:
        bucket = next((b for b in buckets if b >= rows), None)
        return bucket is not None and logit_rows <= min(bucket, max_batch)
    return fits


def test_burst_steps_without_graphs_start_their_grid_at_max_batch_size() -> None:
    steps = burst_steps(4, 64, [])
    planned = [(0, (6,)), (0, (8,)), (1, (11,)), (1, (15,)), (1, (22,)), (1, (15, 16)), (1, (22, 23)), (2, (31, 31))]
    assert steps == [WarmStep(d, prompts, pending=True) for d, prompts in planned]
    assert token_grid(4, 64) == [s.num_tokens for s in steps] == [6, 8, 12, 16, 23, 32, 46, 64]
    assert token_grid(320, 320) == [] and token_grid(320, 200) == []


def _chunks(step: WarmStep) -> list[SeqChunk]:
    """A step's chunks as `ModelRunner._warm_chunks` lays them out (decode rows first)."""
    decode = [SeqChunk([1], 16, {}, True) for _ in range(step.decode_rows)]
    return decode + [SeqChunk([1] * n, 0, {}, True) for n in step.prompts]


def test_burst_steps_run_through_the_runner_and_leave_the_cache_untouched() -> None:
    """Torch path (fast on a CPU): every chunk as planned, the decode rows' tokens read on the
    device, each chunk's logits back, and no block of the KV manager allocated or cached."""
    model_dir = resolve_model("builtin:tiny-llama")
    layout = load_spec(model_dir).cache_layout(512, torch.float32, "cpu")
    kv = KVCacheManager(KvCacheConfig(max_tokens=2048, tokens_per_block=16), layout)
    runner = ModelRunner(model_dir, kv, dtype=torch.float32, device=torch.device("cpu"), max_num_tokens=256,
                         max_batch_size=8, kernels="torch")
    steps = burst_steps(8, 256, _buckets(8, 256))
    before = kv.stats()
    for step in steps:
        chunks = runner._warm_chunks(step)
        assert [len(c.token_ids) for c in chunks] == [1] * step.decode_rows + list(step.prompts)
        assert [c.num_past for c in chunks] == [16] * step.decode_rows + [0] * len(step.prompts)
        assert runner.execute(chunks).shape == (len(chunks), runner.spec.vocab_size)
    assert runner.run_warm_steps(steps) > 0
    assert kv.stats() == before
