"""A mixture-of-experts model's expert load, per server: for each sparse layer, the tokens routed to
each expert over the window (`pdserve_moe_expert_tokens_total{layer,expert}`, each token counted top_k
times) and how uneven they are: the busiest expert's tokens over the mean (1.0: even; the number of
experts: one expert took everything). A dense model's server has no such series: an empty list."""

from __future__ import annotations

from server.dashboard.window import WINDOW_S, Window, counter_increase

EXPERT_TOKENS = "pdserve_moe_expert_tokens_total"


def expert_view(window: Window, now: float) -> list[dict]:
    """[{layer, tokens: [per expert, over the window], total: since the server started, hottest: the
    busiest expert, imbalance: max / mean (None when no token was routed in the window)}], by layer."""
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

