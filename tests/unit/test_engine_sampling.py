"""Sampling and stop rules through the whole engine (not only the sampler)."""

from __future__ import annotations

import engine_harness as eh
import hf_reference
import pytest

from server.models.builtin import resolve_model
from server.types import SamplingParams

LLAMA = "builtin:tiny-llama"
PROMPT = [5, 17, 93, 211, 40, 7, 301, 88, 120, 64]


@pytest.fixture(scope="module")
def core():
    return eh.make_core(LLAMA)


def _run(core, params: SamplingParams, prompt=PROMPT) -> eh.Result:
    return eh.generate(core, [prompt], params)[0]


def test_same_seed_same_output_and_other_seed_differs(core):
    params = SamplingParams(max_tokens=24, temperature=1.2, top_p=0.95, top_k=50, seed=1234, min_tokens=24)
    first, second = _run(core, params), _run(core, params)
    other = _run(core, SamplingParams(max_tokens=24, temperature=1.2, top_p=0.95, top_k=50, seed=99, min_tokens=24))
    assert first.token_ids == second.token_ids
    assert first.token_ids != other.token_ids
    assert first.token_ids != hf_reference.hf_greedy(resolve_model(LLAMA), PROMPT, 24)  # it did sample


def test_stop_token_id_ends_with_stop_and_counts_the_token(core):
    greedy = _run(core, eh.greedy(16)).token_ids
    stop_at = greedy[5]
    first = greedy.index(stop_at)
    out = _run(core, SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=(stop_at,)))
    assert out.token_ids == greedy[: first + 1]
    assert out.final.finish_reason == "stop"


def test_stop_string_truncates_text_and_stream_equals_whole(core):
    full = _run(core, eh.greedy(24))
    stop = full.text[6:9]
    assert stop and stop in full.text
    out = _run(core, SamplingParams(max_tokens=24, temperature=0.0, min_tokens=0, stop=(stop,), ignore_eos=True))
    assert out.final.finish_reason == "stop"
    assert out.text == full.text[: full.text.index(stop)]


def test_eos_stops_unless_ignored_and_min_tokens_forbids_it(core):
    tokenizer = core.tokenizer
    eos = tokenizer.eos_token_id
    prompt = next(p for p in _eos_prompts(core) if p is not None)
    free = _run(core, SamplingParams(max_tokens=40, temperature=0.0), prompt)
    assert free.final.finish_reason == "stop" and free.token_ids[-1] == eos
    ignored = _run(core, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), prompt)
    assert ignored.final.finish_reason == "length" and len(ignored.token_ids) == 40
    assert ignored.token_ids == hf_reference.hf_greedy_ignore_eos(resolve_model(LLAMA), prompt, 40)
    masked = _run(core, SamplingParams(max_tokens=40, temperature=0.0, min_tokens=40), prompt)
    assert eos not in masked.token_ids and len(masked.token_ids) == 40


def _eos_prompts(core):
    """Prompts whose greedy continuation meets EOS within 40 tokens (searched deterministically)."""
    eos = core.tokenizer.eos_token_id
    model_dir = resolve_model(LLAMA)
    for seed in range(200):
        prompt = [(seed * 37 + j * 11) % 480 + 10 for j in range(8)]
        if eos in hf_reference.hf_greedy_ignore_eos(model_dir, prompt, 40):
            yield prompt
    yield None


def test_max_seq_len_caps_generation():
    core = eh.make_core(LLAMA, max_seq_len=32)
    out = _run(core, SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True), PROMPT)
    assert out.final.finish_reason == "length"
    assert len(PROMPT) + len(out.token_ids) == 32


def test_a_request_type_the_role_does_not_serve_is_refused_alone(core):
    from server.types import DisaggParams, GenerateRequest

    for params in (DisaggParams("context_only"), DisaggParams("generation_only", "c1", "tcp://127.0.0.1:1", "e", (5,))):
        [refused] = core.add_request(GenerateRequest("odd", list(PROMPT), eh.greedy(4), disagg=params))
        assert refused.finished and refused.finish_reason == "error" and refused.error_code == 400
        assert params.request_type in refused.error
    assert not core.has_work()
    assert _run(core, eh.greedy(4)).final.finish_reason == "length"  # the engine serves on
