"""schemathesis against the router and both servers of a real deployment.

Every operation of GET /openapi.json, a dozen generated requests each: no answer >= 500, every
4xx in OpenAI's error shape. The servers are fuzzed as a client would reach them (no token: their
`disaggregated_params` paths answer 401) and with the deployment token (generated
`disaggregated_params` then reach the checks behind it: 403 for an unknown KV endpoint, 400 for
missing fields). A longer run is `pdserve-bench fuzz` (figures in docs/RELIABILITY.md).
"""

from __future__ import annotations

import deploy_harness as dh
import httpx
from test_disagg_faults import AUTHORISED, SHARED
from waiting import wait_until

from pdserve_bench.fuzz import FuzzReport, fuzz

EXAMPLES = 12  # per operation and target; `pdserve-bench fuzz` runs longer


def test_fuzz_router_and_servers(tmp_path):
    with dh.launched("disagg.yaml", tmp_path, SHARED) as dep:
        reports = {}
        targets = [("router", dep.url, None), ("generation", dep.generation_urls[0], None),
                   ("context+token", dep.context_urls[0], AUTHORISED),
                   ("generation+token", dep.generation_urls[0], AUTHORISED)]
        for name, url, headers in targets:
            reports[name] = fuzz(url, EXAMPLES, headers, FuzzReport())
        for name, report in reports.items():
            print(report.line(name))
        problems = [p for r in reports.values() for p in r.problems]
        assert problems == []
        assert all(r.cases >= 5 * 5 for r in reports.values())  # every operation, several times
        assert httpx.get(f"{dep.url}/health", timeout=5).status_code == 200  # and everything still serves
        for url in dep.context_urls + dep.generation_urls:
            wait_until(lambda u=url: dep.metric(u, "pdserve_kv_cache_blocks", 'state="in_use"') == 0, 10,
                       what=f"no block left in use on {url}")
