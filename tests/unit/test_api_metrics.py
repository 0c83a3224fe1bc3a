"""`ServerMetrics`: exact names and values in the Prometheus exposition, and `/metrics`."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from test_api_engine_fake import FakeEngine

from server.api.app import create_app
from server.telemetry.metrics import EngineFigures, ServerMetrics
from transceiver.stats import TransferStats

REQUIRED_NAMES = [
    "pdserve_kv_cache_blocks", "pdserve_kv_offloaded_blocks_total", "pdserve_kv_onboarded_blocks_total",
    "pdserve_prefix_cache_query_tokens_total", "pdserve_prefix_cache_hit_tokens_total", "pdserve_requests",
    "pdserve_time_to_first_token_seconds", "pdserve_time_per_output_token_seconds",
    "pdserve_generation_tokens_total", "pdserve_kv_transfer_bytes_total", "pdserve_kv_transfer_seconds",
    "pdserve_kv_transfer_failures_total", "pdserve_kv_transfer_lease_expired_total",
    "pdserve_kv_transfer_rejected_messages_total", "pdserve_kv_transfer_phase_seconds_total",
    "pdserve_num_preemptions_total", "pdserve_prompt_tokens_total",
    "pdserve_e2e_request_latency_seconds", "pdserve_request_queue_time_seconds", "pdserve_prefill_seconds",
]


@dataclass
class Stats:
    """Shaped like kvcache's `KVCacheStats` (cumulative counters + block counts)."""

    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    evictions: int = 0
    offloads: int = 0
    onboards: int = 0
    bytes_offloaded: int = 0
    bytes_onboarded: int = 0
    bytes_copied_primary: int = 0
    disk_offloads: int = 0
    disk_onboards: int = 0
    disk_bytes_written: int = 0
    disk_bytes_read: int = 0
    disk_write_errors: int = 0
    disk_restored: int = 0
    disk_queued_bytes: int = 0
    disk_dropped: dict = field(default_factory=dict)
    blocks: dict = field(default_factory=dict)


def samples(metrics: ServerMetrics) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value, parsed back from the exposition text."""
    text = metrics.render().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_exposition_has_every_required_name_even_before_any_event():
    text = ServerMetrics().render().decode()
    for name in REQUIRED_NAMES:
        assert f"# TYPE {name} " in text or f"# TYPE {name.removesuffix('_total')} " in text, name
        assert f"# HELP {name} " in text, name


def test_kv_stats_are_read_from_the_provider_at_every_scrape():
    blocks = {(2048, "primary", "free"): 10, (2048, "primary", "in_use"): 4,
              (2048, "secondary", "cached"): 7, (64, "primary", "cached"): 2}
    stats = Stats(prefix_query_tokens=640, prefix_hit_tokens=512, offloads=7, onboards=3, evictions=9,
                  bytes_offloaded=7 * 4096, blocks=blocks)
    metrics = ServerMetrics(lambda: EngineFigures(stats))
    got = samples(metrics)
    assert got[("pdserve_prefix_cache_query_tokens_total", ())] == 640
    assert got[("pdserve_prefix_cache_hit_tokens_total", ())] == 512
    assert got[("pdserve_kv_offloaded_blocks_total", ())] == 7
    assert got[("pdserve_kv_onboarded_blocks_total", ())] == 3
    assert got[("pdserve_kv_evicted_blocks_total", ())] == 9
    assert got[("pdserve_kv_offloaded_bytes_total", ())] == 7 * 4096
    blocks = {labels: v for (name, labels), v in got.items() if name == "pdserve_kv_cache_blocks"}
    assert blocks == {
        (("level", "primary"), ("state", "free"), ("window", "2048")): 10,
        (("level", "primary"), ("state", "in_use"), ("window", "2048")): 4,
        (("level", "secondary"), ("state", "cached"), ("window", "2048")): 7,
        (("level", "primary"), ("state", "cached"), ("window", "64")): 2,
    }
    stats.onboards = 5
    stats.blocks[(2048, "primary", "in_use")] = 0
    got = samples(metrics)
    assert got[("pdserve_kv_onboarded_blocks_total", ())] == 5
    in_use = (("level", "primary"), ("state", "in_use"), ("window", "2048"))
    assert got[("pdserve_kv_cache_blocks", in_use)] == 0


def test_disk_tier_figures_are_exposed():
    stats = Stats(disk_offloads=6, disk_onboards=2, disk_bytes_written=6 * 4096, disk_bytes_read=2 * 4096,
                  disk_write_errors=1, disk_restored=4, disk_queued_bytes=8192,
                  disk_dropped={"corrupt": 1, "queue_full": 3},
                  blocks={(2048, "disk", "cached"): 5, (2048, "disk", "free"): 11})
    got = samples(ServerMetrics(lambda: EngineFigures(stats)))
    assert got[("pdserve_kv_disk_offloaded_blocks_total", ())] == 6
    assert got[("pdserve_kv_disk_onboarded_blocks_total", ())] == 2
    assert got[("pdserve_kv_disk_written_bytes_total", ())] == 6 * 4096
    assert got[("pdserve_kv_disk_read_bytes_total", ())] == 2 * 4096
    assert got[("pdserve_kv_disk_write_errors_total", ())] == 1
    assert got[("pdserve_kv_disk_restored_blocks_total", ())] == 4
    assert got[("pdserve_kv_disk_write_queue_bytes", ())] == 8192
    assert got[("pdserve_kv_disk_dropped_blocks_total", (("reason", "corrupt"),))] == 1
    assert got[("pdserve_kv_disk_dropped_blocks_total", (("reason", "queue_full"),))] == 3
    assert got[("pdserve_kv_cache_blocks", (("level", "disk"), ("state", "cached"), ("window", "2048")))] == 5


def test_provider_can_be_set_after_construction():
    metrics = ServerMetrics()
    assert ("pdserve_kv_offloaded_blocks_total", ()) not in samples(metrics)
    metrics.figures = lambda: EngineFigures(Stats(offloads=2))
    assert samples(metrics)[("pdserve_kv_offloaded_blocks_total", ())] == 2


def test_engine_and_transfer_events():
    sender, receiver = TransferStats(), TransferStats()
    figures = EngineFigures(preemptions=4, transfers=[sender, receiver])
    metrics = ServerMetrics(lambda: figures)
    metrics.observe_ttft(0.05)
    metrics.observe_ttft(0.15)
    metrics.observe_tpot(0.004)
    metrics.add_generation_tokens(17)
    metrics.observe_transfer(4096, 0.2)
    metrics.observe_transfer(1024, 0.3)
    receiver.count_failure("timeout")
    sender.count_failure("timeout")
    receiver.count_failure("checksum")
    sender.lease_expired += 1
    for reason in ("mac", "mac", "version"):
        receiver.count_rejected(reason)
    receiver.add_phases(wait=0.25, apply=0.125, rest=0.0625)
    receiver.add_phases(wait=0.25, apply=0.125, rest=0.0625)
    got = samples(metrics)
    assert got[("pdserve_kv_transfer_phase_seconds_total", (("phase", "wait"),))] == 0.5
    assert got[("pdserve_kv_transfer_phase_seconds_total", (("phase", "apply"),))] == 0.25
    assert got[("pdserve_kv_transfer_phase_seconds_total", (("phase", "rest"),))] == 0.125
    assert got[("pdserve_time_to_first_token_seconds_count", ())] == 2
    assert abs(got[("pdserve_time_to_first_token_seconds_sum", ())] - 0.2) < 1e-9
    assert got[("pdserve_time_to_first_token_seconds_bucket", (("le", "0.1"),))] == 1
    assert got[("pdserve_time_per_output_token_seconds_count", ())] == 1
    assert got[("pdserve_generation_tokens_total", ())] == 17
    assert got[("pdserve_kv_transfer_bytes_total", ())] == 5120
    assert got[("pdserve_kv_transfer_seconds_count", ())] == 2
    assert got[("pdserve_kv_transfer_failures_total", (("reason", "timeout"),))] == 2
    assert got[("pdserve_kv_transfer_failures_total", (("reason", "checksum"),))] == 1
    assert got[("pdserve_kv_transfer_lease_expired_total", ())] == 1
    assert got[("pdserve_kv_transfer_rejected_messages_total", ())] == 3
    assert got[("pdserve_num_preemptions_total", ())] == 4
    receiver.count_failure("timeout")  # read from the owners at every scrape
    figures = EngineFigures(preemptions=5, transfers=[sender, receiver])
    got = samples(metrics)
    assert got[("pdserve_kv_transfer_failures_total", (("reason", "timeout"),))] == 3
    assert got[("pdserve_num_preemptions_total", ())] == 5


def test_transfer_counters_are_zero_before_any_provider():
    got = samples(ServerMetrics())
    for name in ("pdserve_kv_transfer_lease_expired_total", "pdserve_kv_transfer_rejected_messages_total",
                 "pdserve_num_preemptions_total"):
        assert got[(name, ())] == 0
        assert (name.replace("_total", "_created"), ()) in got
    assert not [key for key in got if key[0] == "pdserve_kv_transfer_failures_total"]


def test_request_counts_zero_the_states_left_out():
    metrics = ServerMetrics()
    metrics.set_request_counts({"waiting": 2, "running": 1, "preempted": 1})
    metrics.set_request_counts({"running": 3})
    got = samples(metrics)
    requests = {labels[0][1]: v for (name, labels), v in got.items() if name == "pdserve_requests"}
    assert requests == {"waiting": 0, "running": 3, "transferring": 0, "preempted": 0}


def test_registries_are_private_and_counters_thread_safe():
    first, second = ServerMetrics(), ServerMetrics()

    def count() -> None:
        for _ in range(1000):
            first.add_generation_tokens(1)

    threads = [threading.Thread(target=count) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert samples(first)[("pdserve_generation_tokens_total", ())] == 4000
    assert samples(second)[("pdserve_generation_tokens_total", ())] == 0


def test_metrics_route_serves_the_apps_registry():
    metrics = ServerMetrics(lambda: EngineFigures(Stats(prefix_hit_tokens=96)))
    metrics.add_generation_tokens(5)
    with TestClient(create_app(FakeEngine, metrics=metrics)) as client:
        response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=")
    assert "pdserve_prefix_cache_hit_tokens_total 96.0" in response.text
    assert "pdserve_generation_tokens_total 5.0" in response.text
    for name in REQUIRED_NAMES:
        assert f"# HELP {name} " in response.text, name
