"""KVReceiver (real, with a real KVCacheManager) against a scripted context peer on a raw ROUTER:
integrity checks (checksum, byte count, missing chunks), Ack and Cancel, relayed failures."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch
import zmq
from kv_factories import make_manager
from waiting import wait_until

from kvcache import KVCacheManager, Level
from transceiver.config import TransceiverConfig
from transceiver.payload import checksum
from transceiver.receiver import KVReceiver, PullResult
from transceiver.wire import (
    Ack,
    Cancel,
    ChunkHeader,
    Done,
    Failed,
    Hello,
    InstanceInfo,
    PullRequest,
    layout_of,
    link_codec,
)

TOKEN = b"unit-receiver-token-0123"
SLOT = 2 * 2 * 4 * 2 * 8 * 4  # layers * K/V * tpb * kv_heads * head_dim * float32 = 1 KiB


def _kv() -> KVCacheManager:
    return make_manager("cpu", tpb=4, primary_blocks=16, windows=(64, 64), dim=8)


class FakeContext:
    """A context server reduced to a ROUTER socket and a codec, driven step by step by the test."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.codec = link_codec(TOKEN, "ctx-epoch", sender=True)
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.layout = layout_of(kv, {w: kv.pool(w, Level.PRIMARY) for w in kv.window_sizes}, "fp")
        self.peer = b""

    def recv(self):
        assert self.sock.poll(5000), "the receiver sent nothing"
        peer, header, mac = self.sock.recv_multipart()
        self.peer = peer
        return self.codec.open(header, mac)[1]

    def send(self, body, payload: list[bytes] = ()) -> None:
        self.sock.send_multipart([self.peer, *self.codec.seal(body), *payload])

    def accept_pull(self) -> PullRequest:
        assert isinstance(self.recv(), Hello)
        self.send(InstanceInfo(layout=self.layout))
        pull = self.recv()
        assert isinstance(pull, PullRequest)
        return pull


@pytest.fixture
def setup():
    kv = _kv()
    rx = KVReceiver(kv, TransceiverConfig(auth_token=TOKEN.decode()), "fp")
    ctx = FakeContext(kv)
    kv.admit("r", list(range(12)))  # 3 blocks
    slots = kv.slot_table("r", 64)
    rx.start_pull("r", ctx.endpoint, "ctx-epoch", "ctx-r", {64: (0, slots)})
    pull = ctx.accept_pull()
    yield kv, rx, ctx, pull, slots
    rx.close()
    ctx.sock.close(linger=0)


def _wait(rx: KVReceiver) -> PullResult:
    return wait_until(rx.step, 5, "a pull result", step=lambda: rx.wait(0.01))[0]


def _chunk(first: int, count: int, seed: int) -> tuple[ChunkHeader, bytes]:
    data = np.random.default_rng(seed).integers(0, 256, count * SLOT, dtype=np.uint8)
    header = ChunkHeader(pull_id=0, window=64, first=first, count=count, nbytes=data.size,
                         checksum=checksum([data], SLOT, first))
    return header, data.tobytes()


def _send_chunk(ctx: FakeContext, pull: PullRequest, start: int, count: int, seed: int, **changes) -> bytes:
    payload = changes.pop("payload", None)
    header, data = _chunk(start, count, seed)
    header = msgspec.structs.replace(header, pull_id=pull.pull_id, **changes)
    ctx.send(header, [data if payload is None else payload])
    return data


def test_good_chunks_are_written_and_acknowledged(setup) -> None:
    kv, rx, ctx, pull, slots = setup
    assert pull.ctx_request_id == "ctx-r" and pull.ctx_epoch == "ctx-epoch"
    assert [(r.window, r.first, r.count) for r in pull.ranges] == [(64, 0, 3)]
    a = _send_chunk(ctx, pull, 0, 2, seed=1)
    b = _send_chunk(ctx, pull, 2, 1, seed=2)
    ctx.send(Done(pull_id=pull.pull_id, total_bytes=3 * SLOT, chunks=2))
    result = _wait(rx)
    assert (result.ok, result.nbytes) == (True, 3 * SLOT)
    pool = kv.pool(64, Level.PRIMARY).view(kv.num_slots(64), -1).view(torch.uint8)  # [slots, SLOT]
    got = b"".join(pool[s].numpy().tobytes() for s in slots)
    assert got == a + b
    assert ctx.recv() == Ack(pull_id=pull.pull_id, ctx_request_id="ctx-r")
    assert (rx.stats.transfers_ok, rx.stats.bytes_received, rx.num_pulls) == (1, 3 * SLOT, 0)


@pytest.mark.parametrize("changes, error", [
    ({"checksum": 12345}, "chunk checksum mismatch (window 64, blocks 0..1)"),
    ({"payload": b"\0" * SLOT}, f"chunk byte count mismatch: header says {2 * SLOT}, received {SLOT}"),
    ({"first": 1}, "unexpected chunk: window 64, block 1"),
    ({"window": 32}, "unexpected chunk: window 32, block 0"),
])
def test_bad_chunks_fail_the_pull_and_release_the_lease(setup, changes, error) -> None:
    kv, rx, ctx, pull, slots = setup
    _send_chunk(ctx, pull, 0, 2, seed=3, **changes)
    result = _wait(rx)
    assert (result.ok, result.reason) == (False, "integrity")
    assert result.error.startswith(error)
    assert ctx.recv() == Cancel(ctx_request_id="ctx-r", pull_id=pull.pull_id, ctx_epoch="ctx-epoch")
    assert rx.stats.failures_by_reason == {"integrity": 1} and rx.stats.bytes_received == 0
    pool = kv.pool(64, Level.PRIMARY)
    assert torch.count_nonzero(pool[slots]) == 0  # nothing written


def test_done_before_every_block_arrived_fails(setup) -> None:
    _, rx, ctx, pull, _ = setup
    _send_chunk(ctx, pull, 0, 2, seed=4)
    ctx.send(Done(pull_id=pull.pull_id, total_bytes=2 * SLOT, chunks=1))
    result = _wait(rx)
    assert (result.ok, result.reason) == (False, "integrity")
    assert result.error == f"transfer incomplete: windows [64] short, {2 * SLOT}/{2 * SLOT} bytes, 1/1 chunks"


def test_sender_failure_is_relayed_with_its_reason(setup) -> None:
    _, rx, ctx, pull, _ = setup
    ctx.send(Failed(reason="lease_expired", detail="too late", pull_id=pull.pull_id))
    result = _wait(rx)
    assert (result.ok, result.reason, result.error) == (False, "lease_expired", "context server: too late")
    ctx.send(Failed(reason="lease_expired", detail="again", pull_id=pull.pull_id))  # late: ignored
    ctx.sock.send_multipart([ctx.peer, b"garbage"])  # then a marker: the socket thread rejects it
    wait_until(lambda: rx.stats.rejected_messages == 1, 5, "the marker after the late failure read")
    assert rx.step() == [] and rx.stats.failures_by_reason == {"lease_expired": 1}


def test_start_pull_validates_its_arguments() -> None:
    kv = _kv()
    rx = KVReceiver(kv, TransceiverConfig(auth_token=TOKEN.decode()), "fp")
    try:
        with pytest.raises(ValueError, match=r"unknown window 32; valid: \[64\]"):
            rx.start_pull("a", "tcp://127.0.0.1:1", "e", "c", {32: (0, [0])})
        with pytest.raises(ValueError, match=r"window 64: bad first block 0 or slots outside \[0, 16\)"):
            rx.start_pull("a", "tcp://127.0.0.1:1", "e", "c", {64: (0, [16])})
        assert rx.num_pulls == 0
    finally:
        rx.close()
