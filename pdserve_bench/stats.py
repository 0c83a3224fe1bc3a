"""Per-request timings of a serving benchmark and the statistics reported from them.

Times are `time.perf_counter()` seconds of the benchmark process. Definitions (vLLM's `bench serve`):
- TTFT: first streamed text chunk - request start.
- TPOT: (e2e - ttft) / (output_tokens - 1), only for requests with more than one output token.
- ITL: gap between consecutive streamed chunks of one request (a chunk may carry several tokens
  when the server merges them, e.g. an incomplete UTF-8 sequence).
- output tok/s of a run: successful output tokens / (last end - first start).
- goodput (DistServe's): requests per second that finished within the SLO, i.e. with TTFT <= the
  TTFT target and TPOT <= the TPOT target (a one-token answer has no TPOT and meets that part);
  failed requests never meet it. `slo_attainment` is the share of all requests that met it.
A run is summarized as a flat `dict[str, float]`, so K runs reduce to per-key medians.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

Summary = dict[str, float]


@dataclass
class RequestResult:
    """One request's timeline; `first_token` is None when no text arrived (an error)."""

    start: float
    end: float
    first_token: float | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    chunk_times: list[float] = field(default_factory=list)  # arrival time of every text chunk
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.start

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        times = self.chunk_times
        return [b - a for a, b in zip(times, times[1:], strict=False)]


@dataclass(frozen=True)
class SLO:
    """The latency target goodput is counted within (peers' default: TTFT <= 2 s, TPOT <= 50 ms)."""

    ttft_s: float = 2.0
    tpot_s: float = 0.050

    def met_by(self, result: RequestResult) -> bool:
        if not result.ok or result.ttft is None or result.ttft > self.ttft_s:
            return False
        return result.tpot is None or result.tpot <= self.tpot_s

    def as_dict(self) -> dict[str, float]:
        return {"ttft_ms": self.ttft_s * 1e3, "tpot_ms": self.tpot_s * 1e3}


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile (0..100) with linear interpolation between ranks (numpy's default)."""
    if not values:
        return math.nan
    if not 0.0 <= p <= 100.0:
        raise ValueError(f"percentile {p} outside [0, 100]")
    ordered = sorted(values)
    rank = p / 100.0 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else math.nan


def _distribution(prefix: str, seconds: Sequence[float], pcts: Sequence[int]) -> Summary:
    """`{prefix}_mean_ms`, `{prefix}_p{N}_ms` for each N, in milliseconds."""
    out = {f"{prefix}_mean_ms": _mean(seconds) * 1e3}
    for p in pcts:
        out[f"{prefix}_p{p}_ms"] = percentile(seconds, p) * 1e3
    return out


def goodput(results: Sequence[RequestResult], duration_s: float, slo: SLO) -> Summary:
    """Requests/s and output tokens/s of the requests that met `slo`, and the share that did."""
    met = [r for r in results if slo.met_by(r)]
    rate = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: math.nan)
    return {"goodput_req_s": rate(len(met)), "goodput_tok_s": rate(sum(r.output_tokens for r in met)),
            "slo_attainment": len(met) / len(results) if results else math.nan}


def summarize(results: Sequence[RequestResult], slo: SLO | None = None) -> Summary:
    """Throughput, goodput within `slo` (default `SLO()`) and latency distributions of one run
    (errors are counted, not timed)."""
    ok = [r for r in results if r.ok]
    duration = (max(r.end for r in results) - min(r.start for r in results)) if results else math.nan
    out_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    summary: Summary = {
        "requests": float(len(results)),
        "errors": float(len(results) - len(ok)),
        "duration_s": duration,
        "output_tokens": float(out_tokens),
        "output_tok_s": out_tokens / duration if duration > 0 else math.nan,
        "req_s": len(ok) / duration if duration > 0 else math.nan,
        "cache_hit_rate": sum(r.cached_tokens for r in ok) / prompt_tokens if prompt_tokens else 0.0,
    }
    summary |= _distribution("ttft", [r.ttft for r in ok if r.ttft is not None], (50, 90, 99))
    summary |= _distribution("tpot", [r.tpot for r in ok if r.tpot is not None], (50, 90, 99))
    summary |= _distribution("itl", [gap for r in ok for gap in r.itls], (50, 90, 99))
    summary |= _distribution("e2e", [r.e2e for r in ok], (50, 90, 99))
    summary |= goodput(results, duration, slo or SLO())
    return summary


def median_summary(runs: Sequence[Summary]) -> Summary:
    """Per-key median over K runs of the same figure (keys of the first run; NaNs ignored)."""
    if not runs:
        raise ValueError("no runs to reduce")
    out: Summary = {}
    for key in runs[0]:
        values = [run[key] for run in runs if not math.isnan(run[key])]
        out[key] = statistics.median(values) if values else math.nan
    out["runs"] = float(len(runs))
    return out


def ratio(numerator: float, denominator: float) -> float:
    """numerator / denominator, NaN when either is missing or the denominator is 0."""
    if math.isnan(numerator) or math.isnan(denominator) or denominator == 0:
        return math.nan
    return numerator / denominator
