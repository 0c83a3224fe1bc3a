"""`pdserve-bench load`'s breakdown of the time to first token (pdserve_bench/load_figures.py
`phase_figures`): the /metrics texts of a real router registry and of real `ServerMetrics`, scraped
before and after a run as `load_target.scrape` does, give each phase's count, mean (sum and count
increases) and p50 (bucket increases, interpolated); what was observed before the run does not
count; a phase that no scraped server observes is NaN; and the report's table shows them."""

from __future__ import annotations

import math

import pytest
from prometheus_client import generate_latest

from pdserve_bench.load_figures import parse_metrics, phase_figures, series_key
from pdserve_bench.load_report import phase_table
from server.config.router import RouterConfig
from server.router.app import _build_state
from server.telemetry.metrics import ServerMetrics


class Deployment:
    """The registries a pair's scrape reads: its router, its context server and its generation server."""

    def __init__(self) -> None:
        self.router = _build_state(RouterConfig(context_urls=("127.0.0.1:1",), generation_urls=("127.0.0.1:2",)))
        self.context, self.generation = ServerMetrics(), ServerMetrics()

    def scrape(self) -> dict[str, dict[str, float]]:
        return {"server": parse_metrics(self.context.render().decode()),
                "generation": parse_metrics(self.generation.render().decode()),
                "router": parse_metrics(generate_latest(self.router.registry).decode())}

    def serve(self, queue: float, prefill: float, context: float, handoff: float, generation_queue: float,
              pull: float, first_event: float, router_queue: float = 0.0002, generation: float = 0.008) -> None:
        """One request's observations, as the servers and the router make them."""
        self.context.observe_queue_time(queue)
        self.context.observe_prefill(prefill)
        self.context.observe_transfer(4096, pull)  # the sender's side, not a phase
        self.generation.observe_queue_time(generation_queue)
        self.generation.observe_transfer(4096, pull)
        for phase, seconds in (("queue", router_queue), ("context", context), ("handoff", handoff),
                               ("generation", generation), ("first_event", first_event)):
            self.router.observe_phase(phase, seconds)


def test_the_metrics_text_keeps_each_labelled_series_apart():
    deployment = Deployment()
    deployment.serve(0.004, 0.02, 0.06, 0.003, 0.001, 0.004, 0.07)
    router = deployment.scrape()["router"]
    assert router[series_key("pdserve_router_phase_seconds_count", {"phase": "handoff"})] == 1.0
    assert router["pdserve_router_phase_seconds_sum{phase=context}"] == pytest.approx(0.06)
    assert router["pdserve_router_phase_seconds_bucket{le=0.06,phase=context}"] == 1.0
    assert router["pdserve_router_phase_seconds_bucket{le=0.04,phase=context}"] == 0.0
    assert router["pdserve_router_phase_seconds_bucket{le=+Inf,phase=first_event}"] == 1.0
    assert router["pdserve_time_to_first_token_seconds_count"] == 0.0  # SCRAPED's series are always there
    assert not [key for key in router if "_created" in key]


def test_each_phase_of_a_run_from_the_scrapes_before_and_after_it():
    deployment = Deployment()
    deployment.serve(0.2, 0.3, 0.5, 0.1, 0.2, 0.1, 0.5)  # a request before the run: not counted
    before = deployment.scrape()
    for queue, prefill, pull in ((0.004, 0.02, 0.003), (0.006, 0.03, 0.004), (0.03, 0.05, 0.02)):
        deployment.serve(queue, prefill, context=queue + prefill + 0.01, handoff=0.003, generation_queue=0.001,
                         pull=pull, first_event=queue + prefill + 0.012)
    out = phase_figures(before, deployment.scrape())
    assert {key: out[key] for key in out if key.endswith("_count")} == {
        f"phase_{name}_count": 3.0 for name in ("router_queue", "context_queue", "prefill", "context_leg", "handoff",
                                                "generation_queue", "kv_transfer", "generation_leg",
                                                "first_event")}
    assert out["phase_context_queue_mean_ms"] == pytest.approx(40 / 3)
    # 4 ms <= 5, 6 ms <= 10, 30 ms <= 50: the second of three lies halfway up the (5, 10] bucket
    assert out["phase_context_queue_p50_ms"] == pytest.approx(7.5)
    assert out["phase_prefill_mean_ms"] == pytest.approx(100 / 3)
    assert out["phase_prefill_p50_ms"] == pytest.approx(30.0)  # 20 <= 20, 30 <= 40, 50 <= 60: (20, 40] halfway
    assert out["phase_kv_transfer_mean_ms"] == pytest.approx(9.0)  # the generation server's pulls alone
    assert out["phase_kv_transfer_p50_ms"] == pytest.approx(4.375)  # rank 1.5 of the 2 in (2.5, 5], 20 ms above
    assert out["phase_router_queue_mean_ms"] == pytest.approx(0.2)
    assert out["phase_router_queue_p50_ms"] == pytest.approx(0.25)  # all three in (0, 0.5]: half of them
    assert out["phase_handoff_mean_ms"] == pytest.approx(3.0)
    assert out["phase_first_event_mean_ms"] == pytest.approx((40 + 100 + 36) / 3)
    assert out["phase_generation_queue_p50_ms"] == pytest.approx(0.75)  # all in (0.5, 1]: halfway
    assert out["phase_generation_leg_mean_ms"] == pytest.approx(8.0)


def test_an_aggregated_server_has_only_its_queue_and_prefill():
    server = ServerMetrics()
    before = {"server": parse_metrics(server.render().decode())}
    server.observe_queue_time(0.004)
    server.observe_prefill(0.02)
    out = phase_figures(before, {"server": parse_metrics(server.render().decode())})
    assert (out["phase_context_queue_count"], out["phase_prefill_count"]) == (1.0, 1.0)
    assert out["phase_context_queue_mean_ms"] == pytest.approx(4.0) and out["phase_prefill_p50_ms"] == 15.0
    for name in ("router_queue", "context_leg", "handoff", "generation_queue", "kv_transfer", "generation_leg",
                 "first_event"):
        assert out[f"phase_{name}_count"] == 0.0
        assert math.isnan(out[f"phase_{name}_mean_ms"]) and math.isnan(out[f"phase_{name}_p50_ms"])


def test_the_report_table_shows_p50_and_mean_of_each_phase():
    figures = {"phase_prefill_p50_ms": 30.0, "phase_prefill_mean_ms": 33.3333, "phase_handoff_mean_ms": math.nan}
    header, rule, row = phase_table([("disagg: c=64", figures)]).splitlines()
    assert header == ("| TTFT phases, p50 / mean ms | router queue | context queue | prefill | context leg | handoff | "
                      "generation queue | kv transfer | generation leg | first event |")
    assert rule == "|" + "---|" * 10
    assert row == "| disagg: c=64 | - | - | 30.0 / 33.3 | - | - | - | - | - | - |"
