"""What the page shows, computed from the windows of samples: plain JSON-ready dicts, per server and
for the deployment. A server that stopped answering keeps its last figures, marked `stale`; its
rates are None and leave the deployment's sums."""

from __future__ import annotations

from collections.abc import Mapping

from server.dashboard.window import RATE_S, WINDOW_S, Window, counter_increase, merge_buckets, percentiles
from server.router.backends import Backend
from server.telemetry.phases import TTFT_PHASES, Phase, quantile

TTFT = "pdserve_time_to_first_token_seconds"
TPOT = "pdserve_time_per_output_token_seconds"
TRANSFER = "pdserve_kv_transfer_seconds"
HIT, QUERY = "pdserve_prefix_cache_hit_tokens_total", "pdserve_prefix_cache_query_tokens_total"
SPEC_DRAFT, SPEC_ACCEPTED = "pdserve_spec_draft_tokens_total", "pdserve_spec_accepted_tokens_total"
SPEC_EMITTED, SPEC_STEPS = "pdserve_spec_emitted_tokens_total", "pdserve_spec_verify_steps_total"
FIRST_TOKEN_ROLES, DECODE_ROLES = ("context", "aggregated"), ("generation", "aggregated")
PHASE_ROLES = {"prefill": FIRST_TOKEN_ROLES, "generation": ("generation",)}  # a phase's source: its servers' roles
LEVELS = ("primary", "secondary", "disk")
EXPERT_TOKENS = "pdserve_moe_expert_tokens_total"


def server_view(backend: Backend, window: Window, now: float) -> dict:
    latest = window.latest
    view = {"url": backend.url, "role": backend.role, "healthy": backend.healthy,
            "status": backend.status or ("ok" if backend.healthy else "unknown"), "epoch": backend.epoch,
            "restarts": backend.restarts, "last_error": "" if backend.healthy else backend.last_error,
            "in_flight": backend.active, "stale": not window.fresh(now),
            "scraped_s_ago": None if latest is None else round(now - latest.t, 1)}
    if latest is None:
        return view
    view.update(
        requests={state: int(v) for state, v in latest.by_label("pdserve_requests", "state").items()},
        pool=pool_view(latest.series.get("pdserve_kv_cache_blocks", [])),
        **cache_view([window], now),
        tokens_per_s=window.rate("pdserve_generation_tokens_total", now),
        transfers=transfer_view([window], now),
        speculation=spec_view([window], now),
        ttft=percentiles(window.bucket_increase(TTFT, now)),
        tpot=percentiles(window.bucket_increase(TPOT, now)),
        experts=expert_view(window, now))
    return view


def pool_view(series: list[tuple[Mapping[str, str], float]]) -> list[dict]:
    """[{window, level, free, cached, in_use, total}], primary level first; empty levels left out."""
    bars: dict[tuple[int, str], dict] = {}
    for labels, count in series:
        key = (int(labels["window"]), labels["level"])
        bar = bars.setdefault(key, {"window": key[0], "level": key[1], "free": 0, "cached": 0, "in_use": 0})
        bar[labels["state"]] = int(count)
    level_order = lambda level: LEVELS.index(level) if level in LEVELS else len(LEVELS)
    ordered = sorted(bars.values(), key=lambda b: (b["window"], level_order(b["level"])))
    for bar in ordered:
        bar["total"] = bar["free"] + bar["cached"] + bar["in_use"]
    return [bar for bar in ordered if bar["total"] > 0]


def transfer_view(windows: list[Window], now: float) -> dict:
    """KV transfers as the given servers count them: totals, and rates over the last RATE_S."""
    latest = [w.latest for w in windows if w.latest is not None]
    return {"count": int(sum(s.value(f"{TRANSFER}_count") for s in latest)),
            "failures": int(sum(s.value("pdserve_kv_transfer_failures_total") for s in latest)),
            "lease_expired": int(sum(s.value("pdserve_kv_transfer_lease_expired_total") for s in latest)),
            "per_s": _rate(windows, f"{TRANSFER}_count", now),
            "bytes_per_s": _rate(windows, "pdserve_kv_transfer_bytes_total", now)}


def cache_view(windows: list[Window], now: float) -> dict:
    """The prefix cache's hit rate over the window; offloads and onboards per second."""
    return {"prefix_hit_rate": _ratio(_increase(windows, HIT, now), _increase(windows, QUERY, now)),
            "offload_per_s": _rate(windows, "pdserve_kv_offloaded_blocks_total", now),
            "onboard_per_s": _rate(windows, "pdserve_kv_onboarded_blocks_total", now)}


def spec_view(windows: list[Window], now: float) -> dict:
    """Speculative decoding over the window: acceptance, tokens per verify step, drafts per second."""
    return {"acceptance_rate": _ratio(_increase(windows, SPEC_ACCEPTED, now), _increase(windows, SPEC_DRAFT, now)),
            "tokens_per_step": _ratio(_increase(windows, SPEC_EMITTED, now), _increase(windows, SPEC_STEPS, now)),
            "drafts_per_s": _rate(windows, SPEC_DRAFT, now)}


def deployment_view(backends: list[Backend], windows: Mapping[str, Window], router: Window, now: float) -> dict:
    of_roles = lambda roles: [windows[b.url] for b in backends if b.role in roles]
    every = list(windows.values())
    transfers = transfer_view(of_roles(("generation",)), now)
    either_side = transfer_view(every, now)  # failures and lease expiries: whichever side counted them
    transfers.update(failures=either_side["failures"], lease_expired=either_side["lease_expired"])
    latest = router.latest
    return {
        "healthy": sum(b.healthy for b in backends), "servers": len(backends),
        "requests": int(latest.value("pdserve_router_requests_total")) if latest else 0,
        "errors": int(latest.value("pdserve_router_requests_total", outcome="error")) if latest else 0,
        "requests_per_s": router.rate("pdserve_router_requests_total", now),
        **cache_view(every, now),
        "transfers": transfers,
        "speculation": spec_view(of_roles(DECODE_ROLES), now),
        "ttft": percentiles(merge_buckets(w.bucket_increase(TTFT, now) for w in of_roles(FIRST_TOKEN_ROLES))),
        "tpot": percentiles(merge_buckets(w.bucket_increase(TPOT, now) for w in of_roles(DECODE_ROLES))),
        "phases": [phase_view(p, [router] if p.source == "router" else of_roles(PHASE_ROLES[p.source]), now)
                   for p in TTFT_PHASES],
        "window_s": WINDOW_S, "rate_s": RATE_S,
    }


def phase_view(phase: Phase, windows: list[Window], now: float) -> dict:
    """p50, mean (None when nothing was observed) and count of one phase, its sources' histograms merged."""
    h, labels = phase.histogram, phase.labels
    buckets = merge_buckets(w.bucket_increase(h, now, **labels) for w in windows)
    count, total = _increase(windows, f"{h}_count", now, **labels), _increase(windows, f"{h}_sum", now, **labels)
    return {"name": phase.name, "source": phase.source, "p50": quantile(0.5, buckets),
            "mean": _ratio(total, count), "count": int(count)}


def expert_view(window: Window, now: float) -> list[dict]:
    """A mixture-of-experts model's expert load, per sparse layer: [{layer, tokens: [per expert, over
    the window; each token counted top_k times], total: since the server started, hottest: the busiest
    expert, imbalance: max / mean (1.0: even; None when no token was routed in the window)}]. A dense
    model's server has no such series: an empty list."""
    samples = window.recent(now, WINDOW_S)
    if not samples or EXPERT_TOKENS not in samples[-1].series:
        return []
    per_sample = [_counts(s.series.get(EXPERT_TOKENS, [])) for s in samples]
    latest = per_sample[-1]
    sizes: dict[int, int] = {}
    for layer, expert in latest:
        sizes[layer] = max(sizes.get(layer, 0), expert + 1)
    out = []
    for layer in sorted(sizes):
        keys = [(layer, e) for e in range(sizes[layer])]
        tokens = [int(counter_increase(counts.get(key, 0.0) for counts in per_sample)) for key in keys]
        mean = sum(tokens) / len(tokens)
        out.append({"layer": layer, "tokens": tokens, "total": int(sum(latest.get(key, 0.0) for key in keys)),
                    "hottest": max(range(len(tokens)), key=tokens.__getitem__),
                    "imbalance": max(tokens) / mean if mean > 0 else None})
    return out


def _counts(series: list) -> dict[tuple[int, int], float]:
    return {(int(labels["layer"]), int(labels["expert"])): value for labels, value in series}


def _ratio(part: float, whole: float) -> float | None:
    return part / whole if whole > 0 else None


def _increase(windows: list[Window], name: str, now: float, **labels: str) -> float:
    return sum(w.increase(name, now, **labels) for w in windows)


def _rate(windows: list[Window], name: str, now: float) -> float | None:
    """The sum of the windows' rates; None when none has one."""
    present = [r for r in (w.rate(name, now) for w in windows) if r is not None]
    return sum(present) if present else None
