"""The dashboard's numbers: /metrics text parsed back, counter increases across restarts, rates,
histogram quantiles, staleness, and the per-server and deployment views, from real `ServerMetrics`."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest

from kvcache.stats import KVCacheStats
from server.config.router import RouterConfig
from server.dashboard.views import deployment_view, pool_view, server_view
from server.dashboard.window import STALE_S, WINDOW_S, Window, parse_metrics, percentiles, quantile
from server.router.app import _build_state
from server.router.backends import Backend
from server.telemetry.metrics import EngineFigures, ServerMetrics, SpecCounts
from transceiver.stats import TransferStats


def sample(metrics: ServerMetrics, t: float):
    return parse_metrics(metrics.render().decode(), t)


def test_parse_reads_values_labels_and_buckets_of_a_real_exposition():
    stats = KVCacheStats(prefix_query_tokens=64, prefix_hit_tokens=32,
                         blocks={(2048, "primary", "free"): 10, (2048, "primary", "in_use"): 2})
    transfer = TransferStats(failures_by_reason={"timeout": 2, "epoch_mismatch": 1})
    metrics = ServerMetrics(lambda: EngineFigures(stats, transfers=[transfer]))
    metrics.observe_ttft(0.03)
    metrics.observe_ttft(0.3)
    metrics.set_request_counts({"running": 3, "waiting": 1})
    s = sample(metrics, 5.0)
    assert s.t == 5.0
    assert s.value("pdserve_prefix_cache_hit_tokens_total") == 32
    assert s.value("pdserve_kv_transfer_failures_total") == 3
    assert s.value("pdserve_kv_transfer_failures_total", reason="timeout") == 2
    assert s.by_label("pdserve_requests", "state") == {"waiting": 1, "running": 3, "transferring": 0}
    assert s.value("pdserve_kv_cache_blocks", level="primary", state="free") == 10
    buckets = s.buckets("pdserve_time_to_first_token_seconds")
    assert (buckets[0.02], buckets[0.04], buckets[0.25], buckets[0.5], buckets[math.inf]) == (0, 1, 1, 2, 2)
    assert "pdserve_generation_tokens_created" not in s.series
    assert s.value("no_such_metric") == 0


def test_bad_exposition_is_a_value_error():
    with pytest.raises(ValueError):
        parse_metrics("pdserve_requests{state=\"running\" 1\n", 0.0)


def test_increase_and_rate_count_a_restarted_counter_from_zero():
    metrics, window = ServerMetrics(), Window()
    for t, tokens in ((0.0, 0), (1.0, 10), (2.0, 30)):
        metrics.add_generation_tokens(tokens)
        window.add(sample(metrics, t))
    restarted = ServerMetrics()  # the process restarted: its counter starts again from 0
    restarted.add_generation_tokens(5)
    window.add(sample(restarted, 3.0))
    assert window.increase("pdserve_generation_tokens_total", now=3.0) == 10 + 30 + 5
    assert window.rate("pdserve_generation_tokens_total", now=3.0) == pytest.approx(45 / 3.0)
    # the last 1.5 s hold t=2 (40 tokens) and t=3 (5, after the restart): 5 tokens in 1 s, not -35
    assert window.rate("pdserve_generation_tokens_total", now=3.0, seconds=1.5) == 5.0


def test_rates_need_two_fresh_samples_and_old_samples_age_out():
    metrics, window = ServerMetrics(), Window()
    window.add(sample(metrics, 0.0))
    assert window.rate("pdserve_generation_tokens_total", now=0.0) is None  # one sample spans no time
    metrics.add_generation_tokens(8)
    window.add(sample(metrics, 2.0))
    assert window.rate("pdserve_generation_tokens_total", now=2.0) == 4.0
    assert window.fresh(2.0 + STALE_S) and not window.fresh(2.0 + STALE_S + 0.1)
    assert window.rate("pdserve_generation_tokens_total", now=2.0 + STALE_S + 0.1) is None  # the server went quiet
    assert window.increase("pdserve_generation_tokens_total", now=2.0 + WINDOW_S) == 0  # only t=2.0 is left
    window.add(sample(metrics, 70.0))
    assert [s.t for s in window.samples] == [70.0]  # older than a minute: dropped


def test_percentiles_cover_only_the_window():
    metrics, window = ServerMetrics(), Window()
    for seconds in (0.5, 0.5, 0.5):  # before the window's first sample: not counted
        metrics.observe_ttft(seconds)
    window.add(sample(metrics, 0.0))
    for seconds in (0.015, 0.015, 0.015, 0.03):  # buckets (0.01, 0.02] x3, (0.02, 0.04] x1
        metrics.observe_ttft(seconds)
    window.add(sample(metrics, 1.0))
    buckets = window.bucket_increase("pdserve_time_to_first_token_seconds", now=1.0)
    assert buckets[0.02] == 3 and buckets[0.04] == 4 and buckets[math.inf] == 4 and buckets[1.0] == 4
    got = percentiles(buckets)
    assert got["count"] == 4
    assert got["p50"] == pytest.approx(0.01 + 0.01 * 2 / 3)  # rank 2 of 3 in (0.01, 0.02]
    assert got["p90"] == pytest.approx(0.02 + 0.02 * 0.6)  # rank 3.6: 0.6 into (0.02, 0.04]


def test_quantile_edges():
    assert quantile(0.5, {}) is None
    assert quantile(0.5, {0.1: 0, math.inf: 0}) is None
    assert quantile(0.99, {0.1: 1, 1.0: 1, math.inf: 10}) == 1.0  # in +Inf: the highest finite bound
    assert quantile(0.5, {0.1: 4, 0.2: 4, math.inf: 4}) == pytest.approx(0.05)


def test_pool_view_orders_levels_and_drops_a_missing_host_tier():
    stats = KVCacheStats(blocks={
        (2048, "secondary", "free"): 90, (2048, "secondary", "cached"): 10, (2048, "secondary", "in_use"): 0,
        (2048, "primary", "free"): 5, (2048, "primary", "cached"): 3, (2048, "primary", "in_use"): 8,
        (64, "primary", "free"): 4, (64, "primary", "cached"): 0, (64, "primary", "in_use"): 0,
        (64, "secondary", "free"): 0, (64, "secondary", "cached"): 0, (64, "secondary", "in_use"): 0})
    s = sample(ServerMetrics(lambda: EngineFigures(stats)), 0.0)
    assert pool_view(s.series["pdserve_kv_cache_blocks"]) == [
        {"window": 64, "level": "primary", "free": 4, "cached": 0, "in_use": 0, "total": 4},
        {"window": 2048, "level": "primary", "free": 5, "cached": 3, "in_use": 8, "total": 16},
        {"window": 2048, "level": "secondary", "free": 90, "cached": 10, "in_use": 0, "total": 100}]


def two_samples(first: ServerMetrics, then) -> Window:
    window = Window()
    window.add(sample(first, 0.0))
    then(first)
    window.add(sample(first, 2.0))
    return window


def test_server_and_deployment_views():
    ctx_stats = KVCacheStats(prefix_query_tokens=0, prefix_hit_tokens=0,
                             blocks={(2048, "primary", "free"): 30, (2048, "primary", "in_use"): 2})
    ctx_transfer, gen_transfer = TransferStats(), TransferStats()
    ctx_metrics = ServerMetrics(lambda: EngineFigures(ctx_stats, transfers=[ctx_transfer]))
    gen_spec = [SpecCounts()]
    gen_metrics = ServerMetrics(lambda: EngineFigures(transfers=[gen_transfer], spec=gen_spec[0]))

    def ctx_work(m: ServerMetrics) -> None:
        ctx_stats.prefix_query_tokens, ctx_stats.prefix_hit_tokens, ctx_stats.offloads = 200, 50, 6
        m.observe_ttft(0.015)
        ctx_transfer.lease_expired += 1
        m.set_request_counts({"running": 1, "transferring": 2})

    def gen_work(m: ServerMetrics) -> None:
        for _ in range(4):
            m.observe_transfer(1000, 0.002)
        gen_transfer.count_failure("timeout")
        m.observe_tpot(0.003)
        gen_spec[0] = SpecCounts(proposed=40, accepted=30, emitted=40, verified=10)

    ctx, gen = Backend("http://c", "context", healthy=True), Backend("http://g", "generation", healthy=True)
    ctx.status, ctx.epoch, gen.status, gen.restarts = "ok", "e1", "ok", 2
    windows = {ctx.url: two_samples(ctx_metrics, ctx_work), gen.url: two_samples(gen_metrics, gen_work)}
    view = server_view(ctx, windows[ctx.url], now=2.5)
    keys = ("url", "role", "healthy", "status", "epoch", "restarts", "stale", "scraped_s_ago")
    assert {k: view[k] for k in keys} == {
        "url": "http://c", "role": "context", "healthy": True, "status": "ok", "epoch": "e1", "restarts": 0,
        "stale": False, "scraped_s_ago": 0.5}
    assert view["requests"] == {"waiting": 0, "running": 1, "transferring": 2}
    assert view["pool"] == [{"window": 2048, "level": "primary", "free": 30, "cached": 0, "in_use": 2, "total": 32}]
    assert view["prefix_hit_rate"] == 0.25 and view["offload_per_s"] == 3.0 and view["ttft"]["count"] == 1
    assert view["transfers"] == {"count": 0, "failures": 0, "lease_expired": 1, "per_s": 0.0, "bytes_per_s": 0.0}
    assert view["speculation"] == {"acceptance_rate": None, "tokens_per_step": None, "drafts_per_s": 0.0}
    assert server_view(gen, windows[gen.url], now=2.5)["speculation"] == {
        "acceptance_rate": 0.75, "tokens_per_step": 4.0, "drafts_per_s": 20.0}

    router_registry = CollectorRegistry()
    requests = Counter("pdserve_router_requests", "", ["outcome"], registry=router_registry)
    router = Window()
    router.add(parse_metrics(generate_latest(router_registry).decode(), 0.0))
    requests.labels("ok").inc(9)
    requests.labels("error").inc(1)
    router.add(parse_metrics(generate_latest(router_registry).decode(), 2.0))
    deployment = deployment_view([ctx, gen], windows, router, now=2.5)
    assert (deployment["healthy"], deployment["servers"], deployment["requests"], deployment["errors"]) == (2, 2, 10, 1)
    assert deployment["requests_per_s"] == 5.0
    assert deployment["transfers"] == {"count": 4, "failures": 1, "lease_expired": 1, "per_s": 2.0,
                                       "bytes_per_s": 2000.0}
    assert deployment["ttft"]["count"] == 1 and deployment["tpot"]["count"] == 1  # ttft: context; tpot: generation
    assert deployment["prefix_hit_rate"] == 0.25 and deployment["offload_per_s"] == 3.0
    assert deployment["speculation"] == {"acceptance_rate": 0.75, "tokens_per_step": 4.0, "drafts_per_s": 20.0}

    gen.healthy, gen.status = False, "unreachable"  # it stopped answering: last figures kept, stale, no rates
    quiet = server_view(gen, windows[gen.url], now=2.0 + STALE_S + 1)
    assert quiet["stale"] and quiet["restarts"] == 2 and quiet["status"] == "unreachable"
    assert quiet["transfers"]["count"] == 4 and quiet["transfers"]["per_s"] is None
    assert deployment_view([ctx, gen], windows, router, now=2.0 + STALE_S + 1)["transfers"]["per_s"] is None


def test_the_deployment_view_has_each_ttft_phase_from_the_router_and_the_servers():
    """Two context servers' histograms merge; the router's phases are its labelled series apart."""
    state = _build_state(RouterConfig(context_urls=("127.0.0.1:1",), generation_urls=("127.0.0.1:2",)))
    state.observe_phase("first_event", 9.0)  # by the window's first sample: not counted
    router = Window()
    router.add(parse_metrics(generate_latest(state.registry).decode(), 0.0))
    for seconds in (0.03, 0.05, 0.07):
        state.observe_phase("context", seconds)
    router.add(parse_metrics(generate_latest(state.registry).decode(), 2.0))

    def prefill(seconds: tuple[float, ...]):
        def work(m: ServerMetrics) -> None:
            for s in seconds:
                m.observe_queue_time(0.004)
                m.observe_prefill(s)
        return work

    def generation(m: ServerMetrics) -> None:
        m.observe_queue_time(0.002)
        m.observe_transfer(1000, 0.003)

    backends = [Backend("http://c1", "context"), Backend("http://c2", "context"), Backend("http://g", "generation")]
    windows = {"http://c1": two_samples(ServerMetrics(), prefill((0.015,))),
               "http://c2": two_samples(ServerMetrics(), prefill((0.03, 0.05))),
               "http://g": two_samples(ServerMetrics(), generation)}
    phases = {p["name"]: p for p in deployment_view(backends, windows, router, now=2.5)["phases"]}
    assert list(phases) == ["router_queue", "context_queue", "prefill", "context_leg", "handoff", "generation_queue",
                            "kv_transfer", "generation_leg", "first_event"]
    assert phases["prefill"]["source"] == "prefill" and phases["prefill"]["count"] == 3
    assert phases["prefill"]["mean"] == pytest.approx(0.095 / 3)
    assert phases["prefill"]["p50"] == pytest.approx(0.03)  # 15 <= 20, 30 <= 40, 50 <= 60 ms: (20, 40] halfway
    assert phases["context_queue"]["count"] == 3 and phases["context_queue"]["mean"] == pytest.approx(0.004)
    assert phases["context_leg"]["count"] == 3 and phases["context_leg"]["mean"] == pytest.approx(0.05)
    assert phases["context_leg"]["p50"] == pytest.approx(0.05)  # 30 <= 40, 50 <= 60, 70 <= 80 ms: (40, 60] halfway
    assert (phases["generation_queue"]["count"], phases["kv_transfer"]["count"]) == (1, 1)
    for name in ("router_queue", "handoff", "generation_leg", "first_event"):  # shown, nothing observed
        assert phases[name] == {"name": name, "source": "router", "p50": None, "mean": None, "count": 0}


def test_expert_view_shows_each_layers_load_over_the_window_and_its_imbalance():
    """A MoE server's `pdserve_moe_expert_tokens_total{layer,expert}` as the page gets it: per sparse layer,
    the tokens each expert got over the window (a restart counted from zero), the busiest one and max /
    mean; the cumulative total since start. A dense server's view has no experts."""
    from server.dashboard.views import expert_view

    counts: dict[int, list[int]] = {}
    metrics = ServerMetrics(lambda: EngineFigures(expert_tokens=counts))
    window = Window()
    for t, layers in ((0.0, {0: [10, 10, 0, 0], 3: [5, 5, 5, 5]}), (1.0, {0: [16, 10, 2, 0], 3: [5, 7, 5, 7]}),
                      (2.0, {0: [20, 10, 2, 4], 3: [5, 9, 5, 9]})):
        counts.clear()
        counts.update(layers)
        window.add(sample(metrics, t))
    view = expert_view(window, now=2.0)
    assert [v["layer"] for v in view] == [0, 3]
    assert view[0]["tokens"] == [10, 0, 2, 4] and view[0]["total"] == 36 and view[0]["hottest"] == 0
    assert view[0]["imbalance"] == pytest.approx(10 / 4)  # 16 tokens over 4 experts: a mean of 4
    assert view[1]["tokens"] == [0, 4, 0, 4] and view[1]["imbalance"] == pytest.approx(2.0)
    restarted_counts = {0: [1, 0, 0, 0], 3: [0, 0, 0, 0]}
    restarted = ServerMetrics(lambda: EngineFigures(expert_tokens=restarted_counts))
    window.add(sample(restarted, 3.0))  # the server restarted: its counters start again from 0
    view = expert_view(window, now=3.0)
    assert view[0]["tokens"] == [11, 0, 2, 4] and view[0]["total"] == 1
    assert view[1]["tokens"] == [0, 4, 0, 4]
    assert expert_view(window, now=3.0 + WINDOW_S)[1] == {"layer": 3, "tokens": [0, 0, 0, 0], "total": 0,
                                                          "hottest": 0, "imbalance": None}  # nothing routed lately
    moe = Backend("http://m", "aggregated", healthy=True)
    assert server_view(moe, window, now=3.0)["experts"] == view
    dense = Window()
    dense.add(sample(ServerMetrics(), 0.0))
    assert server_view(moe, dense, now=0.0)["experts"] == [] and expert_view(Window(), now=0.0) == []
