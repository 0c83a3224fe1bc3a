"""The engine thread (`AsyncEngine`) runs the one engine loop and reads it as the engine process's
HTTP side does: tokens equal transformers', the step's recorded metrics and state reach /metrics and
`idle()` with the last output, a cache snapshot is a call the loop answers, and a core that cannot
load is the engine's `load_error`."""

from __future__ import annotations

import asyncio

import engine_harness as eh
import hf_reference
from waiting import wait_until_async

from server.engine_host.thread import AsyncEngine
from server.models.builtin import resolve_model
from server.telemetry.metrics import ServerMetrics
from server.types import GenerateRequest

LLAMA = "builtin:tiny-llama"
PROMPT = list(range(30, 70))  # 40 tokens: 2 full blocks of 16 and a partial one


def _value(metrics: ServerMetrics, name: str) -> float:
    return float(next(line.split()[-1] for line in metrics.render().decode().splitlines()
                      if line.startswith(name + " ")))


async def _serve(engine: AsyncEngine):
    engine.start()
    await wait_until_async(engine.is_ready, 60, "the engine thread's Ready")
    outputs = [o async for o in engine.generate(GenerateRequest("r1", PROMPT, eh.greedy(4)))]
    idle = engine.idle()
    snapshot = await engine.snapshot()
    return outputs, idle, snapshot


def test_the_engine_thread_relays_outputs_metrics_state_and_snapshots_through_the_loop():
    metrics = ServerMetrics()
    engine = AsyncEngine(lambda: eh.make_core(LLAMA), "tiny-llama", 512, metrics=metrics, epoch="epoch-1")
    try:
        outputs, idle, snapshot = asyncio.run(_serve(engine))
    finally:
        engine.shutdown()
    assert [t for o in outputs for t in o.new_token_ids] == hf_reference.hf_greedy(resolve_model(LLAMA), PROMPT, 4)
    assert outputs[-1].finished and (outputs[-1].prompt_tokens, outputs[-1].completion_tokens) == (40, 4)
    assert idle and engine.health_problem() is None and engine.links().sender is None
    assert _value(metrics, "pdserve_prompt_tokens_total") == 40
    assert _value(metrics, "pdserve_generation_tokens_total") == 4
    assert _value(metrics, "pdserve_e2e_request_latency_seconds_count") == 1
    queried = engine.core.kv.stats().prefix_query_tokens  # a scrape-time figure, as of the last state
    assert _value(metrics, "pdserve_prefix_cache_query_tokens_total") == queried > 0
    assert _value(metrics, 'pdserve_requests{state="running"}') == 0
    primary = engine.core.kv.cached_blocks()[512]
    assert (snapshot["epoch"], snapshot["seq"], len(snapshot["hashes"])) == ("epoch-1", 0, 2)
    assert snapshot["hashes"] == [h.hex() for level in primary for h in primary[level]]
    assert not engine._thread.is_alive()  # Shutdown ended the loop, which closed what it owns


def test_a_core_that_cannot_load_is_the_engines_load_error():
    def broken():
        raise ValueError("model 'nowhere': no such directory")

    engine = AsyncEngine(broken, "nowhere", 512)

    async def run():
        engine.start()
        return await wait_until_async(lambda: engine.load_error, 10, "the LoadFailed message")

    error = asyncio.run(run())
    engine.shutdown()
    assert str(error) == "ValueError: model 'nowhere': no such directory"
    assert not engine.is_ready()
