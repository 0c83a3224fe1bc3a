"""The server-side phases of a request's time to first token (server/engine/timings.py,
docs/DISAGG_LOAD.md) through real engines on tiny-llama: where a prompt is computed (an aggregated
or a context server) its queue time and its prefill, once per request whatever its choices, which
add up to its time to first token; on a generation server its queue time and its KV pull, once per
request, and no prefill. The engines feed a `MetricsRecorder` as the engine loop does, and what it
took is replayed into a server's `ServerMetrics` (server/telemetry/relay.py)."""

from __future__ import annotations

import engine_harness as eh
import hf_reference
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prompts import random_prompt
from waiting import wait_until

from server.models.builtin import resolve_model
from server.telemetry.metrics import ServerMetrics
from server.telemetry.relay import MetricsRecorder, RelayedMetrics

LLAMA = "builtin:tiny-llama"
QUEUE, PREFILL = "pdserve_request_queue_time_seconds", "pdserve_prefill_seconds"
TTFT, TRANSFER = "pdserve_time_to_first_token_seconds", "pdserve_kv_transfer_seconds"


def recording(core) -> MetricsRecorder:
    recorder = MetricsRecorder()
    core.timings.metrics = recorder
    recorder.watch_transfers(core)
    return recorder


def replayed(recorder: MetricsRecorder) -> dict[str, float]:
    """Unlabelled sample name -> value of the server's /metrics after replaying what was recorded."""
    metrics = ServerMetrics()
    delta = recorder.take()
    assert delta is not None
    RelayedMetrics(metrics).replay(delta)
    assert recorder.take() is None
    return {s.name: s.value for family in text_string_to_metric_families(metrics.render().decode())
            for s in family.samples if not s.labels}


def _expected(prompt: list[int], n: int) -> list[int]:
    return hf_reference.hf_greedy(resolve_model(LLAMA), prompt, n)


def test_an_aggregated_engine_observes_queue_time_and_prefill_once_per_request():
    # two sequences at a time and 32 tokens a step: the third request queues, the 70-token prompt is chunked
    core = eh.make_core(LLAMA, max_num_tokens=32, max_batch_size=2)
    recorder = recording(core)
    prompts = [random_prompt(40 + i, n) for i, n in enumerate([5, 70, 20])]
    ids = [eh.submit(core, p, eh.greedy(4)) for p in prompts]
    results = eh.run_to_completion(core, ids)
    assert [results[rid].token_ids for rid in ids] == [_expected(p, 4) for p in prompts]
    got = replayed(recorder)
    assert (got[f"{QUEUE}_count"], got[f"{PREFILL}_count"], got[f"{TTFT}_count"]) == (3, 3, 3)
    assert got[f"{QUEUE}_sum"] > 0 and got[f"{PREFILL}_sum"] > 0
    # each first token's time is its queue time and its prefill (stamped at the same instants)
    assert got[f"{QUEUE}_sum"] + got[f"{PREFILL}_sum"] == pytest.approx(got[f"{TTFT}_sum"], abs=1e-9)
    assert (got[f"{TRANSFER}_count"], got["pdserve_prompt_tokens_total"]) == (0, 95)


def test_a_request_of_several_choices_is_one_queue_time_and_one_prefill():
    core = eh.make_core(LLAMA)
    recorder = recording(core)
    prompt = random_prompt(7, 12)
    rid = eh.submit(core, prompt, eh.greedy(3, n=3))
    results = eh.run_choices(core, [rid])
    assert [results[(rid, i)].token_ids for i in range(3)] == [_expected(prompt, 3)] * 3
    got = replayed(recorder)
    assert (got[f"{QUEUE}_count"], got[f"{PREFILL}_count"]) == (1, 1)
    assert got[f"{TTFT}_count"] == 3  # one first token per choice


@pytest.fixture
def run():
    with eh.loopback_pair(LLAMA) as pair:
        yield pair


def test_a_pair_observes_each_server_side_phase_once_per_request(run):
    recorders = [recording(core) for core in run.cores]
    prompts = [random_prompt(300 + i, n) for i, n in enumerate([5, 40, 70])]
    gens = run.serve(prompts, eh.greedy(6))
    assert [run.tokens(rid) for rid in gens] == [_expected(p, 6) for p in prompts]
    wait_until(lambda: run.sender.num_leases == 0, 30, "the leases to end", step=run.step)
    context, generation = (replayed(r) for r in recorders)
    # the context server: arrival -> admission -> first token, once each; it sent each prompt's KV once
    assert (context[f"{QUEUE}_count"], context[f"{PREFILL}_count"], context[f"{TTFT}_count"]) == (3, 3, 3)
    assert context[f"{QUEUE}_sum"] + context[f"{PREFILL}_sum"] == pytest.approx(context[f"{TTFT}_sum"], abs=1e-9)
    assert context[f"{TRANSFER}_count"] == 3
    # the generation server: arrival -> admission, and the pull, once each; nothing prefilled
    assert (generation[f"{QUEUE}_count"], generation[f"{TRANSFER}_count"], generation[f"{PREFILL}_count"]) == (3, 3, 0)
    assert generation["pdserve_prompt_tokens_total"] == 0
