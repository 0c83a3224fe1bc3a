"""The engine's health check on a real engine (tiny-llama, real KV manager, a real KV sender for the
context role): stranded pins, stranded requests, leases past their deadline and broken pool state are
reported after the grace period and clear when fixed; `/health` answers 503 naming the reason while
they last, and `/health_generate` runs one real token."""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager

import engine_harness as eh
import pytest
from fastapi.testclient import TestClient
from waiting import wait_until

from server.api.app import create_app
from server.api.routes.health import EPOCH
from server.engine.health import HealthCheck, find_problems
from server.engine.kv_connector import ContextConnector
from server.engine_host.thread import AsyncEngine
from server.types import DisaggParams
from transceiver.config import TransceiverConfig
from transceiver.sender import KVSender

PROMPT = list(range(30, 70))  # 40 tokens: 2 full blocks of 16 and a partial one


def _run(core, prompt=PROMPT, n=4, **kw):
    rid = eh.submit(core, prompt, eh.greedy(n), **kw)
    return eh.run_to_completion(core, [rid])[rid]


def test_a_healthy_engine_reports_nothing():
    core = eh.make_core()
    _run(core)
    check = HealthCheck(interval_s=1.0, grace_s=3.0)
    for now in (0.0, 1.0, 5.0, 10.0):
        check.maybe_check(core, now)
    assert check.problem is None and check.checks == 4
    assert find_problems(core, 10.0, full=True) == {}


def test_pinned_blocks_without_a_lease_turn_unhealthy_after_the_grace_period():
    core = eh.make_core()
    _run(core)
    blocks = list(range(2))  # the prompt's two full blocks, cached (ref 0) after the request ended
    core.kv.pin_blocks(blocks, 512)  # what a lease whose release was lost leaves behind
    check = HealthCheck(interval_s=1.0, grace_s=3.0)
    check.maybe_check(core, 100.0)
    check.maybe_check(core, 100.5)  # within the interval: not even checked
    assert check.checks == 1 and check.problem is None  # seen, but not for the grace period yet
    check.maybe_check(core, 102.0)
    assert check.problem is None
    check.maybe_check(core, 103.0)
    assert check.problem == "stranded_pins: window 512: 2 pins on blocks [0, 1] held by no live lease"
    core.kv.unpin_blocks(blocks, 512)
    check.maybe_check(core, 104.0)
    assert check.problem is None


def test_a_kv_request_that_no_queue_knows_is_stranded():
    core = eh.make_core()
    core.kv.admit("ghost", PROMPT)  # blocks held for a request the scheduler never had
    problems = find_problems(core, 0.0)
    assert problems == {"stranded_requests": "KV requests ['ghost'] hold blocks but are no live request"}
    core.kv.release("ghost")
    assert find_problems(core, 0.0) == {}


def test_broken_pool_state_is_named_by_the_cheap_and_the_idle_full_check():
    core = eh.make_core()
    _run(core)
    bm = core.kv._groups[0].bm
    bm.blocks[0].busy = True  # a cached block marked busy: only the full recomputation sees it
    assert find_problems(core, 0.0) == {}
    assert "block 0 busy=True is stale" in find_problems(core, 0.0, full=True)["kv_integrity"]
    bm.blocks[0].busy = False
    bm.num_refs += 2  # two references that no request holds
    assert find_problems(core, 0.0)["kv_accounting"] == (
        "window 512: blocks count 2 request references, live requests hold 0")
    bm.num_refs -= 2


@pytest.fixture
def context_core():
    core = eh.make_core()
    sender = KVSender(core.kv, TransceiverConfig(auth_token="health-check-token-0123456789"), "fp")
    core.connector = ContextConnector(sender, core.kv)
    yield core
    sender.close()


def test_lease_pins_are_healthy_and_a_lost_lease_is_not(context_core):
    core = context_core
    result = _run(core, disagg=DisaggParams("context_only"))
    lease = result.final.disagg.ctx_request_id
    assert core.kv.num_pins(512) == 3 and core.connector.sender.num_leases == 1
    assert find_problems(core, time.monotonic(), full=True) == {}  # pinned, and a live lease holds them
    core.connector.sender._leases[lease].deadline = time.monotonic() - 10  # never reaped: stuck
    assert find_problems(core, time.monotonic()) == {
        "expired_leases": f"leases ['{lease}'] are past their deadline and still pin blocks"}
    pinned = core.connector.sender._leases.pop(lease).pinned  # the lease is gone, its pins are not
    assert find_problems(core, time.monotonic()) == {
        "stranded_pins": "window 512: 3 pins on blocks [0, 1, 2] held by no live lease"}
    core.connector.sender._unpin(pinned)
    assert find_problems(core, time.monotonic(), full=True) == {}


@asynccontextmanager
async def _engine(engine: AsyncEngine):
    engine.start()
    try:
        yield engine
    finally:
        await asyncio.to_thread(engine.shutdown)


def _wait(client: TestClient, path: str, status: int, timeout_s: float = 60.0):
    return wait_until(lambda: client.get(path), timeout_s, f"{path} answering {status}",
                      check=lambda response: response.status_code == status)


def _core_running(pending: list):
    """A core that runs `pending`'s first function on the engine thread (which owns the KV manager) before
    each step; the engine loop steps on every turn, idle or not."""
    core = eh.make_core()
    step = core.step

    def stepping():
        if pending:
            pending.pop(0)(core)
        return step()

    core.step = stepping
    return core


def test_health_route_says_503_with_the_reason_while_blocks_are_stranded():
    pending: list = []
    engine = AsyncEngine(lambda: _core_running(pending), "tiny-llama", 512)
    engine.health = HealthCheck(interval_s=0.05, grace_s=0.3)
    with TestClient(create_app(lambda: _engine(engine))) as client:
        assert _wait(client, "/health", 200).json() == {"status": "ok", "model": "tiny-llama", "epoch": EPOCH}
        probe = client.get("/health_generate")
        assert probe.status_code == 200 and probe.json()["leg"] == "aggregated"
        pinned: list[int] = []

        def pin_a_cached_block(core) -> None:  # the probe's prompt left one full block cached
            pinned.append(next(b.id for b in core.kv._groups[0].bm.blocks if b.hash is not None))
            core.kv.pin_blocks(pinned, 512)

        pending.append(pin_a_cached_block)
        response = _wait(client, "/health", 503)
        assert response.status_code == 503
        assert response.json() == {"status": "unhealthy", "model": "tiny-llama", "epoch": EPOCH, "reason":
                                   f"stranded_pins: window 512: 1 pins on blocks {pinned} held by no live lease"}
        pending.append(lambda core: core.kv.unpin_blocks(pinned, 512))
        assert _wait(client, "/health", 200).status_code == 200
