"""Log-probabilities, penalties, logit_bias, min_p and seeds on CUDA (Triton kernels, decode graphs,
float32): async scheduling gives the tokens and logprobs of the plain engine, the logprobs are
transformers' on the GPU, verify rows keep them, and an async decode step that computes them still
waits once per step, on an event (they ride with the sampled ids). Skipped without CUDA."""

from __future__ import annotations

import engine_harness as eh
import hf_reference
import pytest
import torch
from prompts import random_prompt
from sampling_harness import logprobs_of, outputs_of, tokens_of

from server.models.builtin import resolve_model
from server.types import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

MODELS = ["builtin:tiny-llama", "builtin:tiny-qwen3-swa"]
TOLERANCE = 2e-4  # GPU kernels against transformers' on the GPU, float32


def _core(model: str, async_on: bool, **kw):
    return eh.make_core(model, device="cuda", kernels="triton", async_scheduling=async_on, **kw)


def _cases() -> list[tuple[list[int], SamplingParams]]:
    return [(random_prompt(1, 12), eh.greedy(20, logprobs=5)),
            (random_prompt(2, 150), eh.greedy(20, prompt_logprobs=3, logprobs=20)),  # chunks of 64
            (random_prompt(3, 30), SamplingParams(max_tokens=20, temperature=0.9, seed=4, frequency_penalty=0.8,
                                            logprobs=2, min_tokens=20)),
            (random_prompt(4, 9), eh.greedy(20, repetition_penalty=1.4, logit_bias=((7, 3.0),), presence_penalty=0.5)),
            (random_prompt(5, 40), SamplingParams(max_tokens=20, temperature=1.2, min_p=0.1, seed=6, min_tokens=20)),
            (random_prompt(6, 70), eh.greedy(20))]


def _run(core, cases) -> list[tuple]:
    ids = [eh.submit(core, p, s) for p, s in cases]
    outs = outputs_of(core, ids)
    return [(tokens_of(outs[i]), [o.logprobs for o in outs[i]], [o.prompt_logprobs for o in outs[i]]) for i in ids]


def _values(entries) -> list[float]:
    return [v for e in entries if e is not None for v in (e.logprob, *(x for _, x in e.top))]


def _check(model: str, prompt: list[int], tokens: list[int], entries, k: int, start: int) -> None:
    sequence = prompt + tokens
    reference = torch.log_softmax(hf_reference.hf_logits(resolve_model(model), sequence, device="cuda"), dim=-1)
    for i, entry in enumerate(entries):
        row = reference[start + i - 1]
        assert entry.token_id == sequence[start + i]
        assert entry.logprob == pytest.approx(row[entry.token_id].item(), abs=TOLERANCE)
        assert [v for _, v in entry.top] == pytest.approx(row.topk(k).values.tolist(), abs=TOLERANCE)


@pytest.mark.parametrize("model", MODELS)
def test_async_equals_sync_and_logprobs_equal_transformers_on_the_gpu(model: str) -> None:
    cases = _cases()
    sync = _run(_core(model, False, max_num_tokens=64, max_batch_size=8), cases)
    core = _core(model, True, max_num_tokens=64, max_batch_size=8)
    pipelined = _run(core, cases)
    for (tokens, lps, plps), (tokens2, lps2, plps2) in zip(sync, pipelined, strict=True):
        assert tokens == tokens2
        flat = [e for o in lps if o for e in o]
        flat2 = [e for o in lps2 if o for e in o]
        assert [e.token_id for e in flat] == [e.token_id for e in flat2]
        assert _values(flat) == pytest.approx(_values(flat2), abs=1e-5)
        assert _values([e for o in plps if o for e in o]) == pytest.approx(_values([e for o in plps2 if o for e in o]),
                                                                           abs=1e-5)
    for (prompt, params), (tokens, lps, plps) in zip(cases, pipelined, strict=True):
        if params.logprobs is not None:
            _check(model, prompt, tokens, [e for o in lps for e in o], params.logprobs, len(prompt))
        if params.prompt_logprobs is not None:
            assert plps[0][0] is None and len(plps[0]) == len(prompt)
            _check(model, prompt, [], plps[0][1:], params.prompt_logprobs, 1)
    assert len(core.counts) == 0 and eh.blocks_in_use(core.kv) == 0


def test_verify_rows_keep_logprobs_and_penalties_on_the_gpu() -> None:
    model = MODELS[0]
    prompts = [random_prompt(20, 14), random_prompt(21, 33)]
    params = [eh.greedy(30, logprobs=4, frequency_penalty=0.7),
              SamplingParams(max_tokens=30, temperature=0.8, seed=9, repetition_penalty=1.3, logprobs=1, min_tokens=30)]
    plain_core = _core(model, True)
    ids = [eh.submit(plain_core, p, sp) for p, sp in zip(prompts, params, strict=True)]
    plain = outputs_of(plain_core, ids)
    expected = {tuple(p): tokens_of(plain[rid]) for p, rid in zip(prompts, ids, strict=True)}
    core = eh.with_replay_drafts(_core(model, True), expected, wrong=3)
    spec_ids = [eh.submit(core, p, sp) for p, sp in zip(prompts, params, strict=True)]
    outs = outputs_of(core, spec_ids)
    for rid, spec_rid in zip(ids, spec_ids, strict=True):
        assert tokens_of(outs[spec_rid]) == tokens_of(plain[rid])
        assert _values(logprobs_of(outs[spec_rid])) == pytest.approx(_values(logprobs_of(plain[rid])), abs=TOLERANCE)
    assert 0 < core.spec.stats.accepted < core.spec.stats.proposed


def test_an_async_decode_step_with_logprobs_and_penalties_waits_once_on_an_event(monkeypatch) -> None:
    """torch's sync debug mode raises on any stream synchronisation; the one wait per step left is
    the event behind the copy of the step's ids and logprobs."""
    core = _core(MODELS[0], True, max_batch_size=8)
    cases = [(random_prompt(60, 20), SamplingParams(max_tokens=64, temperature=0.9, seed=1, min_tokens=40, logprobs=20,
                                              frequency_penalty=0.5)),
             (random_prompt(61, 25), SamplingParams(max_tokens=64, temperature=1.0, min_p=0.05, seed=5,
                                              logit_bias=((9, 1.0),), logprobs=0)),
             (random_prompt(62, 30), eh.greedy(64, repetition_penalty=1.2, presence_penalty=0.3, logprobs=3))]
    eh.decoding(core, cases)
    assert eh.event_waits(core, monkeypatch, 20) == 20
    eh.run_to_completion(core, [])
    assert len(core.counts) == 0
