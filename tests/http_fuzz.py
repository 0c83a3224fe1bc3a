"""HTTP fuzzing of pdserve's OpenAI surface with schemathesis (issue 11, item 8).

`fuzz(base_url, max_examples)` reads the target's GET /openapi.json (server/api/openapi.py), lets
schemathesis generate requests for every operation (valid and invalid bodies, wrong types, odd
strings and numbers) and checks each answer: never a status >= 500, and every 4xx in OpenAI's error
shape `{"error": {"message", "type", "param", "code"}}`. Generated `max_tokens` are capped so a
case stays quick on a CPU. Used by tests/integration/test_http_fuzz.py (few examples, CI) and
scripts/fuzz_http.py (many, figures in docs/RELIABILITY.md).
"""

from __future__ import annotations

import collections
import json
from dataclasses import dataclass, field

import httpx
import schemathesis
from hypothesis import HealthCheck, given, settings

MAX_TOKENS_CAP = 8


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
