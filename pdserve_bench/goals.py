"""The goal comparisons of the engine and disaggregation issues, from raw runs (no torch here).

`Runs` is target -> figure -> one summary per repeat, as `measure` returns it and as
`runs_from_records` rebuilds it from `compare` records. Per comparison: `ratio` = median / median
(the verdict), `paired` = median of the per-repeat ratios, `best` = best run / best run.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from typing import Any

from pdserve_bench.stats import Summary, ratio
from pdserve_bench.tables import Comparison

Runs = dict[str, dict[str, list[Summary]]]


def _series(runs: Runs, part: str, figure: str, key: str) -> list[float] | None:
    found = runs.get(part, {}).get(figure)
    return None if found is None else [summary[key] for summary in found]


def _paired_median(numerators: list[float], denominators: list[float]) -> float:
    values = [ratio(a, b) for a, b in zip(numerators, denominators, strict=True)]
    values = [v for v in values if not math.isnan(v)]
    return statistics.median(values) if values else math.nan


def comparisons(runs: Runs, c1: str, c8: str, shared: str) -> list[Comparison]:
    """Every goal comparison whose two figures (named c1, c8, shared) were measured."""
    tok_s, ttft, cpu = "output_tok_s", "ttft_mean_ms", "server_cpu_ms_per_token"
    specs = [
        ("aggregated c=8 tok/s / HF generate tok/s", ("aggregated", c8, tok_s), ("hf", c1, tok_s), 4.0, True),
        ("aggregated c=1 tok/s / HF generate tok/s", ("aggregated", c1, tok_s), ("hf", c1, tok_s), 1.0, True),
        ("shared-prefix mean TTFT, reuse off / on", ("noreuse", shared, ttft), ("aggregated", shared, ttft),
         3.0, True),
        ("aggregated c=8 tok/s, reuse on / off (0% hits)", ("aggregated", c8, tok_s), ("noreuse", c8, tok_s),
         0.98, True),
        ("disagg c=8 tok/s / aggregated", ("disagg", c8, tok_s), ("aggregated", c8, tok_s), 0.8, True),
        ("disagg c=1 tok/s / aggregated", ("disagg", c1, tok_s), ("aggregated", c1, tok_s), 0.8, True),
        ("disagg c=1 mean TTFT / aggregated", ("disagg", c1, ttft), ("aggregated", c1, ttft), 1.3, False),
        # the same throughput goals in CPU time per output token (2 cores: rate ~ 1 / CPU per token)
        ("CPU/token: HF generate / aggregated c=8", ("hf", c1, cpu), ("aggregated", c8, cpu), 4.0, True),
        ("CPU/token: disagg c=8 / aggregated c=8", ("disagg", c8, cpu), ("aggregated", c8, cpu), 1.25, False),
    ]
    out = []
    for name, num, den, goal, at_least in specs:
        a, b = _series(runs, *num), _series(runs, *den)
        if a is not None and b is not None:
            best = ratio(_best(a, num[2]), _best(b, den[2]))
            out.append(Comparison(name, _median(a), _median(b), goal, at_least,
                                  paired=_paired_median(a, b), best=best))
    return out


def _best(values: list[float], key: str) -> float:
    """The least disturbed run: the lowest latency or CPU cost (`*_ms*`), else the highest rate."""
    kept = [v for v in values if not math.isnan(v)]
    if not kept:
        return math.nan
    return min(kept) if "_ms" in key else max(kept)


def _median(values: list[float]) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return statistics.median(kept) if kept else math.nan


def comparisons_of(runs: Runs) -> list[Comparison]:
    """The comparisons of `compare`'s figure names (its shared-prefix figure at whatever concurrency)."""
    shared = next((f for figs in runs.values() for f in figs if f.startswith("shared-prefix c=")), "")
    return comparisons(runs, "random c=1", "random c=8", shared)


def runs_from_records(records: Iterable[Mapping[str, Any]]) -> Runs:
    """The raw runs of `compare` records again: target -> figure -> one summary per repeat."""
    runs: Runs = {}
    for record in records:
        if record["command"] == "compare":
            config = record["config"]
            runs.setdefault(config["target"], {})[config["figure"]] = list(record["repeats"])
    return runs


