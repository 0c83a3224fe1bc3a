"""KVSender in-process with a real KVCacheManager and a raw DEALER as the receiver: zero-copy frames
of large blocks, unpinning deferred until zmq has released frames of the lease's slots, and leases
that come back however their pull or the socket thread fails."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
import zmq
from kv_factories import make_manager
from waiting import wait_until

from kvcache import KVCacheManager, Level
from transceiver.config import TransceiverConfig
from transceiver.payload import checksum
from transceiver.sender import KVSender
from transceiver.sender.lease import Ended, Offer, OfferedWindow, Started
from transceiver.sender.serve import PullServer
from transceiver.stats import TransferStats
from transceiver.wire import Cancel, ChunkHeader, Done, Failed, PullRequest, WindowRange, link_codec

TOKEN = "unit-sender-token-0123456"
MIB = 1 << 20
W = 1024  # the one window (full attention), tokens


def _kv() -> KVCacheManager:
    # slot: 4 layers * 2 * 64 tpb * 8 * 128 * 2 B = 1 MiB
    return make_manager("cpu", tpb=64, primary_blocks=W // 64, windows=(W,) * 4, max_seq_len=W, heads=8, dim=128,
                        dtype=torch.bfloat16, enable_block_reuse=False)


def _in_use(kv: KVCacheManager) -> int:
    return sum(n for (_, _, state), n in kv.stats().blocks.items() if state == "in_use")


@pytest.fixture
def leased():
    kv = _kv()
    sender = KVSender(kv, TransceiverConfig(auth_token=TOKEN, max_chunk_bytes=2 * MIB), "fp")
    kv.admit("r", list(range(16 * 64)))  # 16 blocks of 1 MiB
    kv.pool(W, Level.PRIMARY).view(torch.uint8).random_(0, 256, generator=torch.Generator().manual_seed(0))
    sender.add_lease("r", {W: kv.block_ids("r", W)})
    slots = kv.slot_table("r", W)
    kv.release("r")
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVHWM, 1)
    dealer.setsockopt(zmq.RCVBUF, 64 * 1024)
    dealer.connect(sender.endpoint)
    codec = link_codec(TOKEN.encode(), "gen", sender=False)
    dealer.send_multipart(codec.seal(PullRequest(pull_id=3, ctx_request_id="r", ctx_epoch=sender.epoch,
                                                 ranges=[WindowRange(window=W, first=0, count=16)])))
    yield kv, sender, dealer, codec, slots
    dealer.close(linger=0)
    sender.close()


def _step_for(sender: KVSender, seconds: float) -> None:
    """Step the sender as an engine would, for `seconds` (at least once)."""
    end = time.monotonic() + seconds
    while True:
        sender.step()
        sender.wait(0.005)
        if time.monotonic() >= end:
            return


def test_large_blocks_go_out_zero_copy_and_arrive_intact(leased) -> None:
    kv, sender, dealer, codec, slots = leased
    rows = kv.pool(W, Level.PRIMARY).view(kv.num_slots(W), -1).view(torch.uint8).numpy()  # [slots, 1 MiB]
    got, done = [], []

    def received_done() -> bool:
        sender.step()
        while dealer.poll(0):
            header, mac, *payload = dealer.recv_multipart()
            _, body = codec.open(header, mac)
            if isinstance(body, Done):
                done.append(body)
            else:
                assert isinstance(body, ChunkHeader) and body.count == 2 and len(payload) >= 1
                parts = [np.frombuffer(p, dtype=np.uint8) for p in payload]
                assert checksum(parts, MIB, body.first) == body.checksum
                got.append((body.first, b"".join(payload)))
        return bool(done)

    wait_until(received_done, 20, "the pull's Done", step=lambda: sender.wait(0.005))
    assert done == [Done(pull_id=3, total_bytes=16 * MIB, chunks=8)]
    assert [first for first, _ in got] == list(range(0, 16, 2))
    for first, data in got:
        assert data == rows[slots[first]].tobytes() + rows[slots[first + 1]].tobytes()
    assert sender.stats.bytes_sent == 16 * MIB


def test_unpin_waits_until_zmq_released_the_frames_of_the_slots(leased) -> None:
    kv, sender, dealer, codec, _ = leased
    # A receiver that reads nothing for a while, on purpose: the sender hands zmq what it can until
    # the socket's buffers are full, and frames of the pool stay with zmq (checked next).
    _step_for(sender, 0.5)
    assert 0 < sender.stats.bytes_sent < 16 * MIB
    sender.drop_lease("r")
    # the lease ends on the socket thread; the engine side takes it back, and unpins only once zmq
    # released the frames (a sender that unpinned at once would have no lease left here)
    wait_until(lambda: sender.busy or sender.num_leases == 0, 20, "the ended lease back on the engine side",
               step=lambda: _step_for(sender, 0))
    assert sender.busy and sender.num_leases == 1 and _in_use(kv) == 16  # ended, but still pinned under the frames
    failed = []

    def unpinned() -> bool:
        while dealer.poll(0):
            header, mac, *_ = dealer.recv_multipart()
            body = codec.open(header, mac)[1]
            failed.extend([body] if isinstance(body, Failed) else [])
        sender.step()
        return bool(failed) and sender.num_leases == 0

    wait_until(unpinned, 20, "the Failed message read and the lease unpinned", interval_s=0.005)
    assert failed == [Failed(reason="cancelled", detail="the context server aborted the request", pull_id=3)]
    assert sender.num_leases == 0 and _in_use(kv) == 0
    kv.check_integrity()
    assert sender.stats.failures_by_reason == {"cancelled": 1}


class _FakeIO:
    """What PullServer needs of a SocketIO: deliver (recorded) and, through `send`, nothing else."""

    def __init__(self) -> None:
        self.items: list = []

    def deliver(self, item) -> None:
        self.items.append(item)


def test_a_lease_comes_back_even_when_its_pull_and_its_failure_notice_cannot_be_sent() -> None:
    def broken_send(io, peer, body, payload) -> None:
        raise zmq.ZMQError(zmq.EFSM, "socket in a bad state")

    stats = TransferStats()
    server = PullServer(TransceiverConfig(auth_token=TOKEN), "e", stats, broken_send, threading.Lock(),
                        lambda: False)
    pool = torch.zeros((4, 256), dtype=torch.int32)  # [slots, 1 KiB]
    server.offer(Offer("r", {W: OfferedWindow(pool, [3, 1], 1024)}))
    io = _FakeIO()
    server.pull(io, b"peer", PullRequest(pull_id=1, ctx_request_id="r", ctx_epoch="e",
                                         ranges=[WindowRange(window=W, first=0, count=2)]))
    assert server.pump(io) is None  # the chunk's send failed: the pull ended, nothing is left to do
    assert io.items == [Started("r"), Ended("r", [])]
    assert stats.failures_by_reason == {"internal_error": 1}


def test_if_the_socket_thread_dies_the_engine_unpins_every_lease_itself(leased) -> None:
    kv, sender, _, _, _ = leased
    assert _in_use(kv) == 16
    sender._thread.close()  # as if it had died
    sender.drop_lease("r")  # cannot be queued: logged, not raised into the engine
    sender.step()
    assert sender.num_leases == 0 and _in_use(kv) == 0
    kv.check_integrity()


def test_parked_pulls_wait_for_their_offer_until_their_time_then_are_refused() -> None:
    """A tensor-parallel part pulled before its lease is offered waits `park_s`: a cancel of another
    pull leaves it, a cancel of its own or its peer gone drops it, and the rest are refused once their
    time is up."""
    sent: list[tuple[bytes, Failed]] = []
    server = PullServer(TransceiverConfig(auth_token=TOKEN), "e", TransferStats(),
                        lambda io, peer, body, payload: sent.append((peer, body)), threading.Lock(),
                        lambda: False, park_s=0.2)
    io = _FakeIO()

    def part(pull_id: int) -> PullRequest:
        return PullRequest(pull_id=pull_id, ctx_request_id="r", ctx_epoch="e", keep_lease=True,
                           ranges=[WindowRange(window=W, first=0, count=1)])

    for peer, pull_id in ((b"a", 1), (b"b", 2), (b"c", 3), (b"d", 4)):
        server.pull(io, peer, part(pull_id))
    server.peer_gone(io, b"d")
    server.cancel(io, b"a", Cancel(ctx_request_id="r", pull_id=9))  # another pull of a: a's stays
    server.cancel(io, b"b", Cancel(ctx_request_id="r", pull_id=2))
    server.expire_parked(io)  # before their time: nothing is refused
    assert sent == []
    time.sleep(0.25)
    server.expire_parked(io)
    assert sorted((peer, body.pull_id, body.reason) for peer, body in sent) == [
        (b"a", 1, "unknown_request"), (b"c", 3, "unknown_request")]
    server.expire_parked(io)  # each once
    assert len(sent) == 2
