"""Speculative decoding on CUDA: Triton kernels, decode CUDA graphs and async scheduling, float32.
Verify steps replay the decode graphs (each verify token a decode row: runner.as_decode_rows) when
they fit the largest bucket, else run eagerly; greedy output equals transformers' and seeded
sampling equals the run without speculation. Skipped without CUDA."""

from __future__ import annotations

import engine_harness as eh
import hf_reference
import pytest
import torch
from prompts import random_prompt

from server.engine.speculative.config import SpeculativeConfig
from server.models.builtin import resolve_model
from server.types import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

MODELS = ["builtin:tiny-llama", "builtin:tiny-qwen3-swa"]


def _core(model: str, **kw):
    return eh.make_core(model, device="cuda", kernels="triton", async_scheduling=True, **kw)


@pytest.mark.parametrize("model", MODELS)
def test_verify_steps_give_transformers_greedy_output_on_the_gpu(model: str) -> None:
    prompts = [random_prompt(i, n) for i, n in enumerate([5, 40, 100, 150, 9])]  # past the 64-token window too
    expected = {tuple(p): hf_reference.hf_greedy(resolve_model(model), p, 40, device="cuda") for p in prompts}
    core = eh.with_replay_drafts(_core(model), expected, wrong=5)
    ids = [eh.submit(core, p, eh.greedy(40)) for p in prompts]
    results, _ = eh.run_checked(core, ids)
    assert [results[i].token_ids for i in ids] == list(expected.values())
    assert 0 < core.spec.stats.accepted < core.spec.stats.proposed
    assert core.runner.graphs is not None and core.runner.graphs.graphs  # plain decode steps replay graphs
    assert eh.blocks_in_use(core.kv) == 0


def test_ngram_and_seeded_sampling_equal_the_run_without_speculation_on_the_gpu() -> None:
    model = "builtin:tiny-llama"
    prompts = [random_prompt(7, 12) * 4, random_prompt(8, 40)]
    greedy = eh.greedy(48)
    plain = [r.token_ids for r in eh.generate(_core(model), prompts, greedy)]
    core = _core(model, speculative=SpeculativeConfig(method="ngram"))
    assert [r.token_ids for r in eh.generate(core, prompts, greedy)] == plain
    assert core.spec.stats.verified > 0
    seeded = SamplingParams(max_tokens=30, temperature=0.8, top_k=40, seed=5)
    sampled = [r.token_ids for r in eh.generate(_core(model), prompts, seeded)]
    replay = eh.with_replay_drafts(_core(model), dict(zip(map(tuple, prompts), sampled, strict=True)), wrong=4)
    assert [r.token_ids for r in eh.generate(replay, prompts, seeded)] == sampled
    assert replay.spec.stats.accepted > 0
