"""HTTP fuzzing of pdserve's OpenAI surface with schemathesis.

`fuzz(base_url, max_examples)` reads the target's GET /openapi.json (server/openai/openapi.py), lets
schemathesis generate requests for every operation (valid and invalid bodies, wrong types, odd
strings and numbers) and checks each answer: never a status >= 500, and every 4xx in OpenAI's error
shape `{"error": {"message", "type", "param", "code"}}`. Generated `max_tokens` are capped so a
case stays quick on a CPU. tests/integration/test_http_fuzz.py runs it with few examples (CI);
the longer run is this subcommand (figures in docs/RELIABILITY.md):

    pdserve-bench fuzz --examples 60

It starts `configs/disagg.yaml` with a deployment token on free loopback ports and fuzzes the router
and both servers, the servers also with the token (generated `disaggregated_params` then reach the
checks behind it). Exit status 1 when any answer was >= 500 or a 4xx was not OpenAI-shaped.
One record: cases and problems per target.
"""

from __future__ import annotations

import argparse
import collections
import json
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import schemathesis
from hypothesis import HealthCheck, given, settings

from pdserve_bench import options
from pdserve_bench.launch import REPO, ServerUnderTest, server_urls

HELP = "schemathesis against the router and both servers of a started deployment"
MAX_TOKENS_CAP = 8
TOKEN_HEADER = "x-pdserve-token"  # what the router sends its servers


@dataclass
class FuzzReport:
    cases: int = 0
    by_status: collections.Counter = field(default_factory=collections.Counter)
    problems: list[str] = field(default_factory=list)

    def line(self, target: str) -> str:
        statuses = ", ".join(f"{s}: {n}" for s, n in sorted(self.by_status.items()))
        return f"{target}: {self.cases} cases ({statuses}); {len(self.problems)} problems"


def _capped(case) -> None:
    body = case.body
    if isinstance(body, dict):
        for key in ("max_tokens", "max_completion_tokens", "min_tokens"):
            if isinstance(body.get(key), int) and not isinstance(body.get(key), bool) and body[key] > MAX_TOKENS_CAP:
                body[key] = MAX_TOKENS_CAP


def check(status: int, text: str) -> str | None:
    """What is wrong with an answer, or None."""
    if status >= 500:
        return f"HTTP {status}: {text[:300]}"
    if 400 <= status < 500:
        try:
            error = json.loads(text)["error"]
            missing = {"message", "type", "param", "code"} - set(error)
        except (ValueError, KeyError, TypeError):
            return f"HTTP {status} without an OpenAI error body: {text[:300]}"
        if missing or not isinstance(error["message"], str) or not error["message"]:
            return f"HTTP {status}: error body lacks {sorted(missing) or 'a message'}: {text[:300]}"
    return None


def fuzz(base_url: str, max_examples: int, headers: dict[str, str] | None = None,
         report: FuzzReport | None = None) -> FuzzReport:
    report = report or FuzzReport()
    document = httpx.get(f"{base_url}/openapi.json", timeout=10).json()
    schema = schemathesis.openapi.from_dict(document)
    for result in schema.get_all_operations():
        operation = result.ok()

        @settings(max_examples=max_examples, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy())
        def run(case) -> None:
            _capped(case)
            response = case.call(base_url=base_url, headers=headers, timeout=60)
            report.cases += 1
            report.by_status[response.status_code] += 1
            problem = check(response.status_code, response.text)
            if problem is not None:
                report.problems.append(f"{case.method} {case.path} {json.dumps(case.body)[:300]} -> {problem}")

        run()
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    options.add_common(parser, repeat=None, model=False)
    parser.add_argument("--model", default="builtin:tiny-llama", help="the model the started servers serve")
    parser.add_argument("--examples", type=int, default=60, help="generated requests per operation and target")
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "disagg.yaml",
                        help="the deployment to start (default configs/disagg.yaml)")


def run(args: argparse.Namespace) -> int:
    token = secrets.token_hex(24)
    started = time.monotonic()
    server = ServerUnderTest(args.config, overrides={"model": args.model,
                                                     "cache_transceiver_config": {"auth_token": token}})
    with server as url:
        authorised = {TOKEN_HEADER: token}
        ctx = server_urls(server.deployment, "context_servers")[0]
        gen = server_urls(server.deployment, "generation_servers")[0]
        targets = [("router", url, None), ("context", ctx, None), ("generation", gen, None),
                   ("context+token", ctx, authorised), ("generation+token", gen, authorised)]
        reports = {name: fuzz(target, args.examples, headers) for name, target, headers in targets}
    seconds = time.monotonic() - started
    for name, report in reports.items():
        print(report.line(name))
        for problem in report.problems[:20]:
            print("   ", problem)
    total, problems = sum(r.cases for r in reports.values()), sum(len(r.problems) for r in reports.values())
    print(f"total: {total} cases, {problems} problems, {seconds:.0f} s")
    figures = {"cases": total, "problems": problems, "seconds": seconds}
    for name, report in reports.items():
        figures |= {f"{name}_cases": report.cases, f"{name}_problems": len(report.problems)}
    options.writer(args).write("fuzz", {"config": str(args.config), "model": args.model,
                                        "examples": args.examples}, figures)
    return 1 if problems else 0
