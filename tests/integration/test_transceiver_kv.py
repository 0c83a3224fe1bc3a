"""KV transfer between two real processes on loopback, each with a real KVCacheManager.

The context process (`ctx_main`, driven over JSON lines on stdin/stdout) prefills by writing a byte
pattern derived from each block's tokens into its slots, after forcing offload/onboard so that
block ids differ from slots, and leases the blocks. This process plays the generation server:
it reuses its own prefix cache, pulls only what it lacks (in-window blocks of the sliding group),
and checks every byte of every block. Fault cases: unknown/expired ids, forged messages, a killed
or restarted context process, an incompatible layout, cancel.
"""

from __future__ import annotations

import json
import time

import msgspec
import pytest
import zmq
from deploy_harness import free_port
from kv_factories import make_manager
from kv_transfer_harness import (
    ContextSide,
    JsonChild,
    assert_blocks_match,
    fill,
    serve_json_commands,
    tokens_for,
)
from waiting import wait_until

from kvcache import KVCacheManager
from server.engine.kv_connector import blocks_to_pull
from transceiver.config import TransceiverConfig
from transceiver.receiver import KVReceiver, PullResult
from transceiver.signed import Envelope, mac
from transceiver.wire import PROTOCOL_VERSION, Hello, Layout, PullRequest, link_codec

TOKEN = "integration-token-0123456789"
TPB = 8
WINDOWS = (32, 256, 32, 256)  # layers 0, 2: sliding window of 32 tokens; layers 1, 3: full
FINGERPRINT = "test-model:v1"


def make_kv(max_blocks: int, host_blocks: int = 0, tpb: int = TPB) -> KVCacheManager:
    # slot = 2 layers * 2 * tpb * 2 * 64 * 4 B = 16 KiB (tpb 8)
    return make_manager("cpu", tpb=tpb, primary_blocks=max_blocks, host_blocks=host_blocks, windows=WINDOWS,
                        max_seq_len=256, dim=64, secondary_offload_min_priority=0)


# ---- the context process ---------------------------------------------------------------------


class _Ctx(ContextSide):
    def __init__(self, timeout_ms: int, port: int) -> None:
        from transceiver.sender import KVSender

        kv = make_kv(max_blocks=16, host_blocks=64)
        cfg = TransceiverConfig(auth_token=TOKEN, kv_transfer_timeout_ms=timeout_ms, port=port,
                                max_chunk_bytes=64 * 1024)  # 4 blocks per chunk
        super().__init__(kv, KVSender(kv, cfg, FINGERPRINT))
        self.pause_after_bytes: int | None = None

    def state(self) -> dict:
        s = self.sender.stats
        return {**super().state(), "lease_expired": s.lease_expired, "rejected": s.rejected_by_reason,
                "bytes_sent": s.bytes_sent}

    def handle(self, cmd: dict) -> dict:
        if cmd["op"] == "pause_after_bytes":
            self.pause_after_bytes = cmd["n"]
            return {}
        return super().handle(cmd)


def ctx_main(timeout_ms: int, port: int) -> None:
    """Context process: answers JSON commands on stdin, steps the sender in between."""
    ctx = _Ctx(timeout_ms, port)
    print(json.dumps({"endpoint": ctx.sender.endpoint, "epoch": ctx.sender.epoch}), flush=True)

    paused = lambda: ctx.pause_after_bytes is not None and ctx.sender.stats.bytes_sent >= ctx.pause_after_bytes
    server = ctx.sender._link._server  # the socket thread's pull server: hold its chunks while paused
    pump = server.pump
    server.pump = lambda io: 0.002 if paused() else pump(io)

    def tick() -> None:
        ctx.sender.step()

    serve_json_commands(ctx.handle, tick, lambda: 0 if ctx.sender.busy else 0.002)
    ctx.sender.close()


class CtxProcess(JsonChild):
    """The test's handle on a context process."""

    def __init__(self, timeout_ms: int = 30000, port: int = 0) -> None:
        super().__init__(__file__, f"ctx_main({timeout_ms}, {port})", startup_timeout_s=60, read_timeout_s=10)
        self.endpoint, self.epoch = self.hello["endpoint"], self.hello["epoch"]


# ---- the generation side (this process) ------------------------------------------------------


def wait_result(rx: KVReceiver, timeout_s: float = 15.0) -> PullResult:
    [result] = wait_until(rx.step, timeout_s, "a pull result", step=lambda: rx.wait(0.01))
    return result


@pytest.fixture(scope="module")
def ctx():
    proc = CtxProcess()
    yield proc
    proc.stop()


@pytest.fixture
def rx():
    receiver = KVReceiver(make_kv(max_blocks=32), TransceiverConfig(auth_token=TOKEN), FINGERPRINT)
    yield receiver
    receiver.close()


def pull(rx: KVReceiver, ctx: CtxProcess, rid: str, tokens: list[int], hit_tokens: int = 0,
         epoch: str | None = None) -> tuple[PullResult, dict]:
    kv = rx._kv
    hit = kv.admit(rid, tokens, max_cached_tokens=hit_tokens)
    wanted = blocks_to_pull(kv, rid, len(tokens), hit)
    rx.start_pull(rid, ctx.endpoint, epoch or ctx.epoch, rid, wanted)
    return wait_result(rx), wanted


def test_pull_after_offload_and_onboard_moves_every_byte(ctx: CtxProcess, rx: KVReceiver) -> None:
    shared = tokens_for(1, 96)
    ctx.call("cache", rid="warm", tokens=shared)  # 12 blocks, cached
    ctx.call("cache", rid="filler", tokens=tokens_for(2, 112))  # 14 blocks: evicts -> offloads "warm"
    tokens = shared[:80] + tokens_for(3, 21)  # 101 tokens: 10 blocks reused from the host pool
    info = ctx.call("prefill", rid="req-a", tokens=tokens)
    assert info["hit"] == 80 and info["offloads"] > 0 and info["onboards"] > 0
    full = str(256)
    moved = [(b, s) for b, s in zip(info["blocks"][full], info["slots"][full], strict=True) if b != s]
    assert moved, "offload/onboard should have made some block id differ from its slot"
    assert info["blocks"]["32"][:8] == [-1] * 8 and min(info["blocks"]["32"][8:]) >= 0  # out of window

    # the generation side already holds the first 3 blocks of the prompt
    rx._kv.admit("seed", tokens[:24])
    fill(rx._kv, "seed", tokens[:24], 0)
    rx._kv.commit("seed", tokens[:24], 24)
    rx._kv.release("seed")
    result, wanted = pull(rx, ctx, "req-a", tokens, hit_tokens=100)
    assert wanted[256][0] == 3 and len(wanted[256][1]) == 10  # full-attention group: blocks 3..12
    assert wanted[32][0] == 8 and len(wanted[32][1]) == 5  # sliding group: only in-window 8..12
    assert result.ok, result.error
    assert result.nbytes == 15 * 16384 == rx.stats.bytes_received
    assert assert_blocks_match(rx._kv, "req-a", tokens) == 13 + 5
    state = ctx.wait_state(lambda s: s["leases"] == 0)
    assert (state["leases"], state["in_use"], state["integrity"], state["transfers_ok"]) == (0, 0, "ok", 1)
    assert rx.stats.transfers_ok == 1 and rx.stats.failures_by_reason == {}
    rx._kv.release("req-a")
    rx._kv.check_integrity()


def test_unknown_ctx_request_fails_fast(ctx: CtxProcess, rx: KVReceiver) -> None:
    start = time.monotonic()
    result, _ = pull(rx, ctx, "nobody", tokens_for(4, 20))
    assert time.monotonic() - start < 5.0
    assert (result.ok, result.reason) == (False, "unknown_request")
    assert "no lease for ctx_request_id 'nobody'" in result.error
    assert rx.num_pulls == 0 and rx.stats.failures_by_reason == {"unknown_request": 1}


def test_epoch_mismatch_fails_without_reading(ctx: CtxProcess, rx: KVReceiver) -> None:
    tokens = tokens_for(5, 40)
    ctx.call("prefill", rid="req-e", tokens=tokens)
    result, _ = pull(rx, ctx, "req-e", tokens, epoch="0" * 32)
    assert (result.ok, result.reason, result.nbytes) == (False, "epoch_mismatch", 0)
    assert "context server restarted" in result.error
    rx.release_remote(ctx.endpoint, "req-e")
    assert ctx.wait_state(lambda s: s["leases"] == 0)["in_use"] == 0


def test_cancel_releases_the_lease(ctx: CtxProcess, rx: KVReceiver) -> None:
    tokens = tokens_for(6, 60)
    ctx.call("prefill", rid="req-c", tokens=tokens)
    ctx.call("pause_after_bytes", n=0)  # the sender stops serving: the pull stays open
    kv = rx._kv
    kv.admit("req-c", tokens)
    rx.start_pull("req-c", ctx.endpoint, ctx.epoch, "req-c", blocks_to_pull(kv, "req-c", 60, 0))
    rx.step()
    rx.cancel("req-c")
    assert rx.num_pulls == 0 and rx.stats.failures_by_reason == {"cancelled": 1}
    ctx.call("pause_after_bytes", n=None)
    state = ctx.wait_state(lambda s: s["leases"] == 0)
    assert (state["leases"], state["in_use"], state["integrity"]) == (0, 0, "ok")
    assert rx.step() == []


def _raw_dealer(endpoint: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def test_forged_messages_are_dropped_and_the_next_pull_succeeds(ctx: CtxProcess, rx: KVReceiver) -> None:
    before = ctx.call("state")["rejected"]
    tokens = tokens_for(7, 50)
    ctx.call("prefill", rid="req-f", tokens=tokens)
    good = link_codec(TOKEN.encode(), "attacker", sender=False)
    steal = PullRequest(pull_id=1, ctx_request_id="not-leased", ctx_epoch=ctx.epoch, ranges=[])
    header, tag = good.seal(steal)
    sock = _raw_dealer(ctx.endpoint)
    try:
        sock.send_multipart(link_codec(b"not-the-deployment-token", "attacker", sender=False).seal(steal))  # forged
        sock.send_multipart([header[:-4], tag])  # truncated
        sock.send_multipart([b"\x00" * 10])  # garbage
        sock.send_multipart([header, tag])
        sock.send_multipart([header, tag])  # replayed
        assert sock.poll(5000)
        _, reply = good.open(*sock.recv_multipart())  # only the one authentic message is answered
        assert (reply.reason, reply.pull_id) == ("unknown_request", 1)
        hello = good.seal(Hello(layout=Layout(tokens_per_block=8, windows=[], fingerprint="x")))
        env = msgspec.msgpack.decode(hello[0], type=Envelope)
        old = msgspec.msgpack.encode(msgspec.structs.replace(env, version=PROTOCOL_VERSION + 1))
        sock.send_multipart([old, mac(good.send_key, old)])  # wrong version, valid MAC
    finally:
        sock.close(linger=0)
    state = ctx.wait_state(lambda s: sum(s["rejected"].values()) - sum(before.values()) >= 5)
    delta = {k: v - before.get(k, 0) for k, v in state["rejected"].items() if v - before.get(k, 0)}
    assert delta == {"bad_mac": 2, "malformed": 1, "replayed": 1, "wrong_version": 1}
    result, _ = pull(rx, ctx, "req-f", tokens)
    assert result.ok, result.error
    assert assert_blocks_match(rx._kv, "req-f", tokens) == 7 + 5


def test_incompatible_layout_is_refused_naming_the_difference(ctx: CtxProcess) -> None:
    kv = make_kv(max_blocks=32, tpb=16)
    receiver = KVReceiver(kv, TransceiverConfig(auth_token=TOKEN), FINGERPRINT)
    try:
        kv.admit("req-i", tokens_for(8, 32))
        wanted = {256: (0, kv.slot_table("req-i", 256))}
        receiver.start_pull("req-i", ctx.endpoint, ctx.epoch, "req-i", wanted)
        result = wait_result(receiver)
        assert (result.ok, result.reason) == (False, "incompatible")
        assert "tokens_per_block differs: context 8 vs generation 16" in result.error
    finally:
        receiver.close()


def test_lease_expires_when_nobody_pulls_and_late_pull_fails() -> None:
    ctx = CtxProcess(timeout_ms=800)
    receiver = KVReceiver(make_kv(max_blocks=32), TransceiverConfig(auth_token=TOKEN), FINGERPRINT)
    try:
        tokens = tokens_for(9, 64)
        ctx.call("prefill", rid="req-x", tokens=tokens)
        assert ctx.call("state")["in_use"] == 8 + 4
        state = ctx.wait_state(lambda s: s["lease_expired"] == 1 and s["leases"] == 0)  # expired, handed back
        assert (state["lease_expired"], state["leases"], state["in_use"]) == (1, 0, 0)
        assert state["integrity"] == "ok"
        result, _ = pull(receiver, ctx, "req-x", tokens)
        assert (result.ok, result.reason) == (False, "unknown_request")
    finally:
        receiver.close()
        ctx.stop()


def _free_port() -> int:
    return free_port()


def test_killed_context_fails_the_pull_at_once_and_a_restart_changes_epoch() -> None:
    port = _free_port()
    ctx = CtxProcess(port=port)
    kv = make_kv(max_blocks=32)
    receiver = KVReceiver(kv, TransceiverConfig(auth_token=TOKEN, kv_transfer_timeout_ms=1500), FINGERPRINT)
    try:
        tokens = tokens_for(10, 100)
        ctx.call("prefill", rid="req-k", tokens=tokens)
        ctx.call("pause_after_bytes", n=1)  # stop after the first pump (at most 4 of the 6 chunks)
        kv.admit("req-k", tokens)
        receiver.start_pull("req-k", ctx.endpoint, ctx.epoch, "req-k", blocks_to_pull(kv, "req-k", 100, 0))
        def first_bytes() -> bool:
            assert receiver.step() == []  # no result before the kill
            return receiver.stats.bytes_received > 0

        wait_until(first_bytes, 10, "the first bytes", step=lambda: receiver.wait(0.01))
        ctx.kill()
        killed = time.monotonic()
        result = wait_result(receiver)
        assert (result.ok, result.reason) == (False, "peer_gone"), result
        assert result.error == f"the context server at {ctx.endpoint} is unreachable (connection lost)"
        assert 0 < result.nbytes == receiver.stats.bytes_received <= 13 * 16384 < 18 * 16384
        assert time.monotonic() - killed < 1.0  # kv_transfer_timeout_ms is 1500
        old_epoch = ctx.epoch
        ctx = CtxProcess(port=port)  # the context server restarts on the same address
        assert ctx.epoch != old_epoch
        ctx.call("prefill", rid="req-k", tokens=tokens)
        receiver.start_pull("req-k", ctx.endpoint, old_epoch, "req-k", blocks_to_pull(kv, "req-k", 100, 0))
        result = wait_result(receiver)
        assert (result.ok, result.reason) == (False, "epoch_mismatch")
        receiver.start_pull("req-k", ctx.endpoint, ctx.epoch, "req-k", blocks_to_pull(kv, "req-k", 100, 0))
        result = wait_result(receiver)
        assert result.ok, result.error
        assert assert_blocks_match(kv, "req-k", tokens) == 13 + 5
    finally:
        receiver.close()
        ctx.stop()
