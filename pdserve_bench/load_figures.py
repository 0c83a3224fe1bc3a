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
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence

from pdserve_bench.stats import SLO, RequestResult, Summary, percentile, ratio, summarize

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


def parse_metrics(text: str) -> dict[str, float]:
    """`NAME_sum` and `NAME_count` of the histograms in `SCRAPED` (unlabelled series, summed)."""
    wanted = {f"{name}_{part}" for name in SCRAPED.values() for part in ("sum", "count")}
    out: dict[str, float] = dict.fromkeys(wanted, 0.0)
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in wanted:
            out[name] += float(value.split()[0])
    return out


def server_means(before: Mapping[str, float], after: Mapping[str, float], prefix: str = "server") -> Summary:
    """Mean TTFT, queue time, TPOT and E2E (ms) over the requests a server finished between two scrapes."""
    out: Summary = {}
    for short, name in SCRAPED.items():
        count = after.get(f"{name}_count", 0.0) - before.get(f"{name}_count", 0.0)
        total = after.get(f"{name}_sum", 0.0) - before.get(f"{name}_sum", 0.0)
        out[f"{prefix}_{short}_mean_ms"] = total / count * 1e3 if count > 0 else math.nan
    return out
