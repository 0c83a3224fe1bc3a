"""A deployment under load and one measured run on it: the client's figures, the servers' own.

`measure_run` scrapes the servers' /metrics, runs the plan from the client processes, scrapes
again, and returns the run's summary (`load_figures`) and its per-second series. A started
deployment's servers are scraped by role: `server` for those that answer the first token (an
aggregated server, a pair's context servers), `generation` for a pair's generation servers, and
`router` for a pair's router. A deployment given by URL is scraped at that URL, or at the servers
`--scrape` names. Besides each role's means, the summary has the phases of the time to first
token (`phase_*`: server/telemetry/phases.py, docs/DISAGG_LOAD.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from pdserve_bench.client import served_model
from pdserve_bench.launch import ServerUnderTest, is_disaggregated, server_urls
from pdserve_bench.load_client import LoadPlan, run_load
from pdserve_bench.load_figures import (
    Series,
    load_summary,
    parse_metrics,
    phase_figures,
    server_means,
    steady_tok_s,
    time_series,
    window_figures,
)
from pdserve_bench.stats import SLO, Summary

SCRAPE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class LoadTarget:
    name: str
    url: str
    model: str  # as GET /v1/models names it
    scrape: tuple[tuple[str, str], ...]  # (role label, base URL) of the servers whose /metrics are read
    startup_s: float = math.nan  # from the start to a healthy deployment, when started here


def url_target(name: str, url: str, scrape: tuple[tuple[str, str], ...] = ()) -> LoadTarget:
    """A running deployment; its /metrics are read at `scrape` (role, URL), by default at `url`."""
    return LoadTarget(name, url, served_model(url), scrape or (("server", url),))


def started_target(name: str, server: ServerUnderTest) -> LoadTarget:
    """The deployment `server` started (entered already)."""
    deployment = server.deployment
    if is_disaggregated(deployment):
        scrape = tuple(("server", u) for u in server_urls(deployment, "context_servers"))
        scrape += tuple(("generation", u) for u in server_urls(deployment, "generation_servers"))
        if not server_urls(deployment, "context_servers"):  # generation servers alone answer everything
            scrape = tuple(("server", u) for _, u in scrape)
        scrape += (("router", server.url),)
    else:
        scrape = (("server", server.url),)
    return LoadTarget(name, server.url, served_model(server.url), scrape, server.startup_s)


def scrape(servers: Sequence[tuple[str, str]]) -> dict[str, dict[str, float]]:
    """role -> summed histogram sums and counts of that role's servers (empty for a server that fails)."""
    out: dict[str, dict[str, float]] = {}
    for role, url in servers:
        try:
            text = httpx.get(f"{url}/metrics", timeout=SCRAPE_TIMEOUT_S).text
        except httpx.HTTPError:
            continue
        into = out.setdefault(role, {})
        for key, value in parse_metrics(text).items():
            into[key] = into.get(key, 0.0) + value
    return out


def _server_figures(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> Summary:
    out: Summary = {}
    for role in dict.fromkeys([*before, *after]):
        if role != "router":  # the router has no server histograms
            out |= server_means(before.get(role, {}), after.get(role, {}), prefix=role)
    return out | phase_figures(before, after)


def measure_run(target: LoadTarget, plan: LoadPlan, vocab: Sequence[int], procs: int, slo: SLO,
                window_s: float, bin_s: float, *, scrape_metrics: bool = True) -> tuple[Summary, Series]:
    """One run of `plan` on `target`: its summary (client figures, first window, the rate between
    the ramp's end and the duration's, the servers' means) and its time series."""
    before = scrape(target.scrape) if scrape_metrics else {}
    found = run_load(plan, target.url, target.model, vocab, procs)
    after = scrape(target.scrape) if scrape_metrics else {}
    results = found.all
    summary = load_summary(found.by_traffic, slo) | window_figures(results, found.t0, window_s)
    end = math.nan if plan.duration_s is None else found.t0 + plan.duration_s
    summary |= {"client_procs": float(found.workers), "client_busiest_core_share": found.busiest_worker,
                "steady_output_tok_s": steady_tok_s(results, found.t0 + plan.ramp_s, end)}
    summary |= _server_figures(before, after)
    return summary, time_series(results, found.t0, bin_s)
