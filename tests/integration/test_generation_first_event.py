"""A generation server speaks soon after the handoff. The router's `generation` phase (a stream's
generation leg started -> the first event it relays, docs/DISAGG_LOAD.md) is read one request at a
time on a real pair; a generation server that sits on a pulled request (the `slow_first_event`
fault of tests/faults: each arrived pull held SLOW_FIRST_EVENT_S before its engine sees it) fails
the same check, so the check catches a generation server that is slow to send its first event."""

from __future__ import annotations

import json
import os
import sys

import deploy_harness as dh
import httpx
import pytest

FAULTS = dh.ROOT / "tests" / "faults"
sys.path.insert(0, str(FAULTS))
from sitecustomize import SLOW_FIRST_EVENT_S  # noqa: E402

REQUESTS = 5
# A CPU pair of the tiny model relays the generation leg's first event some 10-60 ms after the leg
# starts (a pull of a few blocks, one decode step); the bound leaves room for a busy machine and is
# still far below a second's wait.
BOUND_S = 0.5


@pytest.fixture(scope="module")
def fault_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("faults")


@pytest.fixture(scope="module")
def dep(tmp_path_factory, fault_dir):
    env = {"PYTHONPATH": os.pathsep.join([str(FAULTS), os.environ.get("PYTHONPATH", "")]),
           "PDSERVE_TEST_FAULT_DIR": str(fault_dir)}
    with dh.launched("disagg.yaml", tmp_path_factory.mktemp("first-event"), env=env) as deployment:
        yield deployment


def _stream(url: str, prompt: str) -> int:
    """One streamed completion read to its end; its completion tokens (from the usage chunk)."""
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    tokens = 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                tokens = (json.loads(line[6:]).get("usage") or {}).get("completion_tokens", tokens)
    return tokens


def generation_leg_mean_s(dep: dh.Deployment, tag: str) -> float:
    """The mean `generation` phase of REQUESTS streams sent one at a time."""
    def figure(part: str) -> float:
        return dep.metric(dep.url, f"pdserve_router_phase_seconds_{part}", 'phase="generation"')

    count, total = figure("count"), figure("sum")
    for i in range(REQUESTS):
        assert _stream(dep.url, f"{tag} {i}: the generation server answers " * 4) == 8
    count, total = figure("count") - count, figure("sum") - total
    assert count == REQUESTS, dep.logs()
    return total / count


def test_the_generation_server_speaks_soon_after_the_handoff(dep):
    mean = generation_leg_mean_s(dep, "plain")
    print(f"generation leg to its first event: mean {1000 * mean:.1f} ms over {REQUESTS} requests")
    assert mean < BOUND_S, dep.logs()


def test_a_generation_server_slow_to_send_its_first_event_is_caught(dep, fault_dir):
    (fault_dir / "slow_first_event").touch()
    try:
        mean = generation_leg_mean_s(dep, "slow")
    finally:
        (fault_dir / "slow_first_event").unlink()
    assert mean >= SLOW_FIRST_EVENT_S > BOUND_S  # the check of the test above fails for this server
