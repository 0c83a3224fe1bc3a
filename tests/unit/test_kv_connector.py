"""The KV connectors on their own (no engine): a context connector's offer leases blocks and answers
with where they are; a generation connector pulls them and reports arrivals and failures as data.
Real KVSender / KVReceiver on loopback, real KV managers."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from kv_factories import loopback_link, make_manager

from kvcache import KVCacheManager, Level
from server.engine.kv_connector import AggregatedConnector, Arrived, ContextConnector, GenerationConnector, PullFailure
from server.engine.request import Request
from server.types import DisaggParams, SamplingParams

W, TPB = 64, 4
PROMPT = list(range(3, 13))  # 10 tokens: blocks 0, 1 full, block 2 holds 2


def _kv() -> KVCacheManager:
    return make_manager("cpu", tpb=TPB, primary_blocks=W // TPB, windows=(W, W), max_seq_len=W, dim=8,
                        enable_block_reuse=False)


def _request(rid: str, params: DisaggParams) -> Request:
    return Request(rid, list(PROMPT), SamplingParams(max_tokens=4), frozenset(), disagg=params)


@pytest.fixture
def pair():
    ctx_kv, gen_kv = _kv(), _kv()
    with loopback_link(ctx_kv, gen_kv) as (sender, receiver):
        gen = GenerationConnector(receiver, gen_kv)
        gen.seconds_seen = 0.0
        receiver.stats.on_transfer = lambda seconds, nbytes: setattr(gen, "seconds_seen", gen.seconds_seen + seconds)
        yield ContextConnector(sender, ctx_kv), gen


def _poll_until_idle(ctx: ContextConnector, gen: GenerationConnector) -> tuple[list[str], list[PullFailure]]:
    """Poll both sides until the generation side has no pull left; what ended meanwhile."""
    arrived, failed = [], []
    deadline = time.monotonic() + 30
    while gen.busy():
        assert time.monotonic() < deadline, "the pulls did not end"
        ctx.poll()
        more_arrived, more_failed = gen.poll()
        arrived, failed = arrived + more_arrived, failed + more_failed
        gen.receiver.wait(0.01)
    return arrived, failed


def test_offer_then_pull_moves_the_prompt_blocks_and_reports_arrivals_and_failures(pair) -> None:
    ctx, gen = pair
    ctx.kv.admit("c", PROMPT)
    ctx.kv.pool(W, Level.PRIMARY).view(torch.uint8).random_(0, 256, generator=torch.Generator().manual_seed(0))
    prefilled = _request("c", DisaggParams("context_only"))
    prefilled.append_token(99)
    [params] = ctx.offer([prefilled])
    assert (params.ctx_request_id, params.ctx_endpoint, params.ctx_epoch, params.first_gen_tokens,
            params.prompt_token_ids) == ("c", ctx.sender.endpoint, ctx.sender.epoch, (99,), tuple(PROMPT))
    src = ctx.kv.slot_table("c", W)[:3]
    ctx.kv.release("c")  # the engine ends the context leg: the lease's pins keep the blocks
    assert ctx.sender.num_leases == 1 and ctx.kv.num_pins(W) == 3

    good = _request("g", dataclasses.replace(params, request_type="generation_only"))
    bad = _request("b", dataclasses.replace(params, request_type="generation_only", ctx_request_id="nope"))
    for request in (good, bad):
        gen.kv.admit(request.request_id, PROMPT, num_tokens=len(PROMPT) + 1, max_cached_tokens=len(PROMPT))
    gen.start_pulls([good, bad])
    assert gen.busy()
    arrived, failed = _poll_until_idle(ctx, gen)
    assert arrived == [Arrived("g")]
    assert [(f.request_id, f.code) for f in failed] == [("b", 404)]
    assert failed[0].message.startswith("KV transfer from the context server failed: ")
    ctx_pool, gen_pool = (kv.pool(W, Level.PRIMARY).view(torch.uint8) for kv in (ctx.kv, gen.kv))
    assert torch.equal(gen_pool[gen.kv.slot_table("g", W)[:3]], ctx_pool[src])  # the bytes, block for block
    # the one successful pull's time, split into phases that add up to it (exported as
    # pdserve_kv_transfer_phase_seconds_total{phase})
    phases, stats = gen.receiver.stats.phase_seconds, gen.receiver.stats
    assert stats.transfers_ok == 1 and set(phases) == {"wait", "apply", "rest"}
    assert phases["wait"] > 0 and phases["apply"] > 0 and min(phases.values()) >= 0
    assert sum(phases.values()) == pytest.approx(received_seconds(gen), abs=1e-6)


def received_seconds(gen: GenerationConnector) -> float:
    """The successful pull's total time as the receiver reported it (its on_transfer hook)."""
    return gen.seconds_seen


def test_release_cancels_a_running_pull_or_frees_the_remote_lease(pair) -> None:
    ctx, gen = pair
    ctx.kv.admit("c", PROMPT)
    prefilled = _request("c", DisaggParams("context_only"))
    prefilled.append_token(99)
    [params] = ctx.offer([prefilled])
    ctx.kv.release("c")
    request = _request("g", dataclasses.replace(params, request_type="generation_only"))
    gen.kv.admit("g", PROMPT, num_tokens=len(PROMPT) + 1, max_cached_tokens=len(PROMPT))
    gen.start_pulls([request])
    gen.release(request)  # aborted mid-pull: the pull ends here and now, before its blocks are freed
    assert gen.receiver.num_pulls == 0 and not gen.busy()
    deadline = time.monotonic() + 30
    while ctx.sender.num_leases:  # the Cancel reached the context side: its lease ended
        assert time.monotonic() < deadline, "the lease was not released"
        ctx.poll()
        ctx.sender.wait(0.01)
    assert ctx.kv.num_pins(W) == 0 and gen.poll() == ([], [])


def test_the_aggregated_connector_serves_both_phases_and_hands_nothing_over() -> None:
    connector = AggregatedConnector()
    assert connector.accepts == ("context_and_generation",)
    assert connector.poll() == ([], []) and not connector.busy()
    with pytest.raises(AssertionError):
        connector.offer([_request("c", DisaggParams("context_only"))])
