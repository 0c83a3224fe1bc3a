"""server/telemetry/relay.py: what the engine loop records (on either host) shows on the HTTP
process's /metrics exactly as if the engine had fed `ServerMetrics` itself (histograms, counters,
scrape-time figures), after a trip through the engine link's codec."""

from __future__ import annotations

import re
import secrets
import threading

from kvcache.stats import KVCacheStats
from server.engine_host.wire import EngineState, StepOut, link_codec
from server.telemetry.metrics import ServerMetrics, SpecCounts
from server.telemetry.relay import EngineFigures, MetricsRecorder, RelayedMetrics, TransferFigures
from transceiver.stats import TransferStats

KV = KVCacheStats(prefix_query_tokens=40, prefix_hit_tokens=32, evictions=2, offloads=1, onboards=1,
                  bytes_offloaded=4096, bytes_onboarded=4096, bytes_copied_primary=0,
                  blocks={(512, "primary", "free"): 20, (512, "primary", "in_use"): 3})
COUNTS = {"waiting": 1, "running": 2, "transferring": 0}


def observe(metrics) -> None:
    """What an engine and its transceiver report in a few steps."""
    metrics.add_prompt_tokens(40)
    metrics.observe_ttft(0.012)
    for seconds in (0.003, 0.004, 0.2):
        metrics.observe_tpot(seconds)
    metrics.add_generation_tokens(4)
    metrics.observe_e2e(0.3)
    metrics.observe_queue_time(0.0005)
    metrics.observe_prefill(0.0115)
    metrics.observe_transfer(65536, 0.02)


def samples(metrics: ServerMetrics) -> list[str]:
    """The exposition without the `_created` timestamps (they differ between two registries)."""
    return [line for line in metrics.render().decode().splitlines() if not re.search(r"_created(\{| )", line)]


def transfer_stats() -> TransferStats:
    stats = TransferStats(lease_expired=1, rejected_messages=2)
    stats.count_failure("timeout")
    stats.add_phases(wait=0.5, apply=0.25)
    return stats


def test_a_relayed_engine_shows_the_same_metrics_as_an_engine_in_this_process():
    stats = transfer_stats()
    spec = SpecCounts(proposed=8, accepted=5, emitted=7, verified=2)
    experts = {0: [5, 1, 0, 2], 2: [3, 3, 1, 1]}  # a MoE model's layers 0 and 2: tokens per expert
    direct = ServerMetrics(lambda: EngineFigures(KV, {}, 3, [stats], spec, experts))  # the live TransferStats
    direct.set_request_counts(COUNTS)
    observe(direct)

    recorder = MetricsRecorder()  # the engine loop
    worker = threading.Thread(target=observe, args=(recorder,))  # the transceiver's threads observe too
    worker.start()
    worker.join()
    secret = secrets.token_bytes(32)
    http, engine = link_codec(secret, engine_side=False), link_codec(secret, engine_side=True)
    figures = EngineFigures(KV, COUNTS, 3, [TransferFigures.of(stats)], spec, experts)
    _, message = http.open(*engine.seal(StepOut([], recorder.take(), EngineState(figures=figures))))
    assert recorder.take() is None  # taken once

    relayed = ServerMetrics()  # the HTTP process
    relay = RelayedMetrics(relayed)
    relay.replay(message.metrics)
    relay.update(message.state.figures)
    assert samples(relayed) == samples(direct)
    assert "pdserve_time_to_first_token_seconds_count 1.0" in samples(relayed)
    assert "pdserve_prefill_seconds_sum 0.0115" in samples(relayed)
    assert 'pdserve_request_queue_time_seconds_bucket{le="0.0005"} 1.0' in samples(relayed)
    assert 'pdserve_kv_transfer_failures_total{reason="timeout"} 1.0' in samples(relayed)
    assert "pdserve_spec_accepted_tokens_total 5.0" in samples(relayed)
    assert "pdserve_spec_acceptance_rate 0.625" in samples(relayed)
    assert "pdserve_spec_tokens_per_step 3.5" in samples(relayed)
    assert 'pdserve_moe_expert_tokens_total{expert="0",layer="2"} 3.0' in samples(relayed)
