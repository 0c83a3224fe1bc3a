"""Async scheduling on CUDA: the engine with Triton kernels and decode CUDA graphs, float32.
Async outputs equal sync outputs and transformers' on the GPU; async decode steps never synchronise
the stream (the one wait per step is an event's), and a step returns while the step it launched is
still on the GPU. Skipped without CUDA."""

from __future__ import annotations

import engine_harness as eh
import hf_reference
import pytest
import torch
from prompts import random_prompt

from server.models.builtin import resolve_model
from server.types import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

MODELS = ["builtin:tiny-llama", "builtin:tiny-qwen3-swa"]


def _core(model: str, async_on: bool, **kw):
    return eh.make_core(model, device="cuda", kernels="triton", async_scheduling=async_on, **kw)


def _cases() -> list[tuple[list[int], SamplingParams]]:
    lengths = [5, 40, 100, 150, 9, 64, 33, 1, 77, 20]  # past tiny-qwen3-swa's 64-token window too
    cases = [(random_prompt(i, n), eh.greedy(24)) for i, n in enumerate(lengths)]
    cases += [(random_prompt(50, 12), SamplingParams(max_tokens=24, temperature=1.1, top_p=0.9, top_k=40, seed=3)),
              (random_prompt(51, 30), SamplingParams(max_tokens=24, temperature=0.7, seed=4, min_tokens=24)),
              (random_prompt(52, 8), SamplingParams(max_tokens=3, temperature=0.0)),
              (random_prompt(53, 8), SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=(100, 200, 300)))]
    return cases


def _run(core, cases) -> list[tuple]:
    ids = [eh.submit(core, p, s) for p, s in cases]
    results, _ = eh.run_checked(core, ids)
    return [(results[i].token_ids, results[i].text, results[i].final.finish_reason) for i in ids]


@pytest.mark.parametrize("model", MODELS)
def test_async_equals_sync_and_transformers_on_the_gpu(model: str) -> None:
    cases = _cases()
    sync = _run(_core(model, False, max_num_tokens=128, max_batch_size=8), cases)
    core = _core(model, True, max_num_tokens=128, max_batch_size=8)
    assert core.runner.graphs is not None and core.runner.graphs.graphs
    assert _run(core, cases) == sync
    assert core.runner.graphs.mixed_replays > 0  # prefill chunks rode in decode graphs (runner.replay_plan)
    for (prompt, params), (tokens, _, _) in zip(cases, sync, strict=True):
        if params == eh.greedy(24):
            assert tokens == hf_reference.hf_greedy(resolve_model(model), prompt, 24, device="cuda")
    assert eh.blocks_in_use(core.kv) == 0


def test_an_async_decode_step_waits_once_on_an_event(monkeypatch) -> None:
    """torch's sync debug mode raises on any stream or device synchronisation (a blocking copy,
    .item(), .tolist() of a device tensor); what is left are event waits, counted through a spy
    on torch.cuda.Event.synchronize: one per step, on the tokens of the step before."""
    core = _core(MODELS[0], True, max_batch_size=8)
    cases = [(random_prompt(60 + i, 20), SamplingParams(max_tokens=64, temperature=0.9, seed=i, min_tokens=40))
             for i in range(2)]
    cases += [(random_prompt(62, 25), SamplingParams(max_tokens=64, temperature=1.0, top_k=50, top_p=0.9, seed=5)),
              (random_prompt(70, 30), eh.greedy(64))]
    eh.decoding(core, cases)
    assert eh.event_waits(core, monkeypatch, 20) == 20
    eh.run_to_completion(core, [])


def _sleep_cycles(ms: float) -> int:
    """GPU clock cycles for `torch.cuda._sleep` to take about `ms` milliseconds."""
    cycles = 10_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return int(cycles * ms / start.elapsed_time(end))


def test_a_step_returns_while_the_step_it_launched_runs() -> None:
    """A slow GPU (50 ms of sleep queued before each step): sync, each step waits for its own
    forward, so the stream is idle when it returns; async, it waits only for the step before, so
    the step it launched is still queued: the host schedules the next step meanwhile."""
    cycles = _sleep_cycles(50)
    for async_on in (False, True):
        core = _core(MODELS[0], async_on, max_batch_size=8)
        eh.decoding(core, [(random_prompt(80 + i, 16), eh.greedy(40)) for i in range(4)])
        busy = []
        for _ in range(5):
            torch.cuda._sleep(cycles)  # on the engine's stream, before this step's launch
            core.step()
            busy.append(not torch.cuda.current_stream().query())
        assert busy == [async_on] * 5, async_on
        eh.run_to_completion(core, [])
