"""Figures of one load run: the run's summary, each traffic class's own, the first window against the
rest, and per-second time series.

- `load_summary`: `stats.summarize` of every request and the streamed text chunks per output token
  (`chunks_per_token`), plus for a run of several classes (the mixed workload) each class's TTFT /
  TPOT / ITL / E2E under `CLASS_` (e.g. `background_tpot_p99_ms`, `long_ttft_p50_ms`): the
  interference of long prefills shows in the background's TPOT and ITL.
- `window_figures`: mean TTFT of the requests that started in the first `window_s` seconds against
  those that started later (`first_vs_later_ttft`): a fresh server's first minute.
- `steady_tok_s`: output tokens that arrived between two times, per second (a closed-loop run's
  rate once every stream has started and before any has stopped).
- `time_series`: per `bin_s` bin from the run's start, the requests started, their mean TTFT, the
  output tokens that arrived (a chunk's tokens spread evenly over the request's chunks) per second,
  and the errors. NaN where a bin has nothing to average.
- `server_means` and `phase_figures`: the servers' and the router's own histograms between two
  scrapes of their /metrics (`parse_metrics`): mean TTFT, queue time, TPOT, E2E per role, and each
  phase of the time to first token (server/telemetry/phases.py) with its mean and p50.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Mapping, Sequence

from pdserve_bench.stats import SLO, RequestResult, Summary, percentile, ratio, summarize
from server.telemetry.phases import TTFT_PHASES, Phase, quantile

SPLIT_KEYS = ("requests", "errors", "output_tok_s", "ttft_mean_ms", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms",
              "tpot_mean_ms", "tpot_p50_ms", "tpot_p90_ms", "tpot_p99_ms", "itl_p50_ms", "itl_p99_ms",
              "e2e_p50_ms", "e2e_p99_ms", "goodput_req_s", "slo_attainment")
Series = dict[str, list[float]]


def load_summary(by_traffic: Mapping[str, Sequence[RequestResult]], slo: SLO) -> Summary:
    """The whole run's figures; with more than one class of traffic, each class's too."""
    everything = [r for rs in by_traffic.values() for r in rs]
    out = summarize(everything, slo)
    # SSE sends text only: below 1, some tokens decoded to no text (or merged), and TTFT / ITL count chunks
    chunks = sum(len(r.chunk_times) for r in everything if r.ok)
    out["chunks_per_token"] = chunks / out["output_tokens"] if out["output_tokens"] else math.nan
    if len(by_traffic) > 1:
        for name, results in by_traffic.items():
            own = summarize(results, slo)
            out |= {f"{name}_{key}": own[key] for key in SPLIT_KEYS}
    return out


def _mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else math.nan


def window_figures(results: Sequence[RequestResult], t0: float, window_s: float) -> Summary:
    """Mean TTFT (ms) of the successful requests started in [t0, t0 + window_s) against the later ones."""
    ttft = [(r.start - t0, r.ttft) for r in results if r.ok and r.ttft is not None]
    first = [t for at, t in ttft if at < window_s]
    later = [t for at, t in ttft if at >= window_s]
    first_ms, later_ms = _mean(first) * 1e3, _mean(later) * 1e3
    return {"window_s": window_s, "ttft_mean_first_window_ms": first_ms, "ttft_mean_later_ms": later_ms,
            "ttft_p90_first_window_ms": percentile(first, 90) * 1e3, "first_window_requests": float(len(first)),
            "first_vs_later_ttft": ratio(first_ms, later_ms)}


def steady_tok_s(results: Sequence[RequestResult], start: float, end: float) -> float:
    """Output tokens per second that arrived in [start, end) (a chunk's tokens spread over its request's chunks)."""
    if math.isnan(end) or end <= start:
        return math.nan
    tokens = 0.0
    for r in results:
        if r.ok and r.chunk_times:
            per_chunk = r.output_tokens / len(r.chunk_times)
            tokens += per_chunk * sum(1 for at in r.chunk_times if start <= at < end)
    return tokens / (end - start)


def _bin(at: float, bin_s: float) -> int:
    return max(0, int(at // bin_s))


def time_series(results: Sequence[RequestResult], t0: float, bin_s: float = 1.0) -> Series:
    """Columns `t_s` (bin start), `started`, `ttft_mean_ms`, `output_tok_s`, `errors`, one value per bin."""
    if bin_s <= 0:
        raise ValueError(f"bin_s must be > 0, got {bin_s}")
    last = max((r.end for r in results), default=t0)  # every chunk arrives before its request ends
    bins = _bin(last - t0, bin_s) + 1
    started, errors, tokens = [0.0] * bins, [0.0] * bins, [0.0] * bins
    ttfts: list[list[float]] = [[] for _ in range(bins)]
    for r in results:
        b = _bin(r.start - t0, bin_s)
        started[b] += 1
        if not r.ok:
            errors[b] += 1
        elif r.ttft is not None:
            ttfts[b].append(r.ttft * 1e3)
        per_chunk = r.output_tokens / len(r.chunk_times) if r.ok and r.chunk_times else 0.0
        for at in r.chunk_times if per_chunk else ():
            tokens[_bin(at - t0, bin_s)] += per_chunk
    return {"t_s": [i * bin_s for i in range(bins)], "started": started,
            "ttft_mean_ms": [_mean(t) for t in ttfts], "output_tok_s": [n / bin_s for n in tokens],
            "errors": errors}


# ---- the servers' own view (Prometheus text of GET /metrics) ---------------------------------------

SCRAPED = {  # figure prefix -> histogram name; a mean is (sum after - before) / (count after - before)
    "ttft": "pdserve_time_to_first_token_seconds",
    "queue": "pdserve_request_queue_time_seconds",
    "tpot": "pdserve_time_per_output_token_seconds",
    "e2e": "pdserve_e2e_request_latency_seconds",
}


HISTOGRAMS = {*SCRAPED.values(), *(p.histogram for p in TTFT_PHASES)}
_PARTS = ("sum", "count", "bucket")
_LABEL = re.compile(r'(\w+)="([^"]*)"')
# a phase's source -> the scraped roles that hold it; the router's histograms are its own names,
# so they are read from every role scraped (a deployment given by URL is often a router's)
PHASE_ROLES = {"prefill": ("server",), "generation": ("generation",)}


def series_key(name: str, labels: Mapping[str, str]) -> str:
    """`name{a=x,b=y}` (labels sorted, unquoted), or `name` without labels: the keys of `parse_metrics`."""
    return name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}" if labels else "")


def parse_metrics(text: str) -> dict[str, float]:
    """The `_sum`, `_count` and `_bucket` series of the histograms the figures read (`SCRAPED`, the
    phases'), keyed by `series_key` and summed over equal keys; an unlabelled sum or count of
    `SCRAPED` that `text` lacks is 0."""
    out: dict[str, float] = dict.fromkeys((f"{name}_{part}" for name in SCRAPED.values()
                                           for part in ("sum", "count")), 0.0)
    for line in text.splitlines():
        series, _, value = line.partition(" ")
        name, _, labels = series.partition("{")
        histogram, _, part = name.rpartition("_")
        if histogram in HISTOGRAMS and part in _PARTS:
            key = series_key(name, dict(_LABEL.findall(labels)))
            out[key] = out.get(key, 0.0) + float(value.split()[0])
    return out


def server_means(before: Mapping[str, float], after: Mapping[str, float], prefix: str = "server") -> Summary:
    """Mean TTFT, queue time, TPOT and E2E (ms) over the requests a server finished between two scrapes."""
    out: Summary = {}
    for short, name in SCRAPED.items():
        count = after.get(f"{name}_count", 0.0) - before.get(f"{name}_count", 0.0)
        total = after.get(f"{name}_sum", 0.0) - before.get(f"{name}_sum", 0.0)
        out[f"{prefix}_{short}_mean_ms"] = total / count * 1e3 if count > 0 else math.nan
    return out


def _delta(before: Mapping[str, float], after: Mapping[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def _bucket_delta(before: Mapping[str, float], after: Mapping[str, float], phase: Phase) -> dict[float, float]:
    """Upper bound -> the run's increase of that cumulative bucket of `phase`'s series."""
    prefix = f"{phase.histogram}_bucket{{"
    out: dict[float, float] = {}
    for key in after:
        if key.startswith(prefix):
            labels = dict(pair.split("=", 1) for pair in key[len(prefix):-1].split(","))
            le = labels.pop("le")
            if labels == phase.labels:
                out[math.inf if le == "+Inf" else float(le)] = _delta(before, after, key)
    return out


def phase_figures(before: Mapping[str, Mapping[str, float]], after: Mapping[str, Mapping[str, float]]) -> Summary:
    """Each phase of the time to first token over a run, from role -> `parse_metrics` scrapes before
    and after it: `phase_NAME_count` (observations), `phase_NAME_mean_ms` (the sum's increase over
    the count's) and `phase_NAME_p50_ms` (the buckets' increases, interpolated as Prometheus'
    histogram_quantile does); NaN where no scraped server observed it."""
    out: Summary = {}
    every = tuple(dict.fromkeys([*before, *after]))
    for phase in TTFT_PHASES:
        roles = PHASE_ROLES.get(phase.source, every)
        pairs = [(before.get(r, {}), after.get(r, {})) for r in roles]
        count = sum(_delta(b, a, series_key(f"{phase.histogram}_count", phase.labels)) for b, a in pairs)
        total = sum(_delta(b, a, series_key(f"{phase.histogram}_sum", phase.labels)) for b, a in pairs)
        buckets: dict[float, float] = {}
        for b, a in pairs:
            for le, n in _bucket_delta(b, a, phase).items():
                buckets[le] = buckets.get(le, 0.0) + n
        p50 = quantile(0.5, buckets) if count > 0 else None
        out |= {f"phase_{phase.name}_count": count,
                f"phase_{phase.name}_mean_ms": total / count * 1e3 if count > 0 else math.nan,
                f"phase_{phase.name}_p50_ms": p50 * 1e3 if p50 is not None else math.nan}
    return out
