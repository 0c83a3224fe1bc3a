"""Structured output on CUDA (Triton kernels, decode CUDA graphs, float32): the bitmask is filled in
pinned memory on the CPU and applied on the GPU. Async scheduling gives the sync outputs; the
constrained ones are valid JSON that finishes, and the unconstrained requests of the same steps are
transformers' greedy. Skipped without CUDA."""

from __future__ import annotations

import json
import random

import engine_harness as eh
import hf_reference
import pytest
import torch
from json_schemas import check, random_schema
from prompts import random_prompt

from server.models.builtin import resolve_model
from server.types import SamplingParams, StructuredSpec

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _run(core, cases) -> list[tuple]:
    ids = [eh.submit(core, p, s) for p, s in cases]
    results, _ = eh.run_checked(core, ids)
    return [(results[i].token_ids, results[i].text, results[i].final.finish_reason) for i in ids]


@pytest.mark.parametrize("model", ["builtin:tiny-llama", "builtin:tiny-qwen3-swa"])
def test_constrained_outputs_on_the_gpu_async_equal_sync(model: str) -> None:
    rng = random.Random(5)
    schemas = [random_schema(rng) for _ in range(12)]
    cases = [(random_prompt(i, 4 + 3 * i), SamplingParams(max_tokens=300, temperature=0.0 if i % 2 else 0.8, seed=i,
                                                     structured=StructuredSpec("json_schema", json.dumps(s))))
             for i, s in enumerate(schemas)]
    free = [(random_prompt(100 + i, 20), eh.greedy(32)) for i in range(3)]
    results = [_run(eh.make_core(model, device="cuda", kernels="triton", async_scheduling=flag,
                                 max_num_tokens=128, max_batch_size=16), cases + free) for flag in (False, True)]
    assert results[1] == results[0]
    for schema, (_, text, reason) in zip(schemas, results[1][:len(cases)], strict=True):
        assert reason == "stop"
        check(json.loads(text), schema)
    for (prompt, _), (tokens, _, _) in zip(free, results[1][len(cases):], strict=True):
        assert tokens == hf_reference.hf_greedy(resolve_model(model), prompt, 32, device="cuda")
