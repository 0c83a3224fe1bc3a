"""Longer HTTP fuzz run (issue 11 item 8): schemathesis against the router and both servers of a
`configs/disagg.yaml` deployment on loopback; prints the cases and statuses per target.

    .venv/bin/python scripts/fuzz_http.py --examples 60

The CI test (tests/integration/test_http_fuzz.py) runs the same checks with fewer examples.
Exit status 1 when any answer was >= 500 or a 4xx was not in OpenAI's error shape.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path[:0] = [str(TESTS), str(TESTS / "integration")]

import deploy_harness as dh  # noqa: E402
from http_fuzz import FuzzReport, fuzz  # noqa: E402
from test_disagg_faults import AUTHORISED, SHARED  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=60, help="generated requests per operation and target")
    args = parser.parse_args()
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp, dh.launched("disagg.yaml", Path(tmp), SHARED) as dep:
        targets = [("router", dep.url, None), ("context", dep.context_urls[0], None),
                   ("generation", dep.generation_urls[0], None),
                   ("context+token", dep.context_urls[0], AUTHORISED),
                   ("generation+token", dep.generation_urls[0], AUTHORISED)]
        reports = {name: fuzz(url, args.examples, headers, FuzzReport()) for name, url, headers in targets}
    for name, report in reports.items():
        print(report.line(name))
        for problem in report.problems[:20]:
            print("   ", problem)
    total = sum(r.cases for r in reports.values())
    problems = sum(len(r.problems) for r in reports.values())
    print(f"total: {total} cases, {problems} problems, {time.monotonic() - started:.0f} s")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
