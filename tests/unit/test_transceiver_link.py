"""The context side's socket thread on real loopback sockets: bad messages are dropped and counted
without stalling it, handshakes are answered, pulls are served from offered slots by the thread
itself (no engine involved) and each lease comes back to the engine once (`Ended`)."""

from __future__ import annotations

import time

import msgspec
import numpy as np
import pytest
import torch
import zmq
from kv_transfer_harness import delivered
from waiting import wait_until

from transceiver.config import TransceiverConfig
from transceiver.link import SocketThread, shared_context
from transceiver.payload import checksum
from transceiver.sender.lease import Ended, Offer, OfferedWindow, Started, Withdraw
from transceiver.sender.link import SenderLink
from transceiver.signed import Envelope, SignedCodec, mac
from transceiver.stats import TransferStats
from transceiver.wire import (
    PROTOCOL_VERSION,
    Ack,
    ChunkHeader,
    Done,
    Failed,
    Hello,
    InstanceInfo,
    Layout,
    PullRequest,
    WindowLayout,
    WindowRange,
    link_codec,
)

TOKEN = "s" * 24
LAYOUT = Layout(tokens_per_block=4, fingerprint="fp", windows=[
    WindowLayout(window=128, layers=[0, 1], kv_heads=2, head_dim=8, dtype="float32", slot_bytes=1024)])


@pytest.fixture
def sender_link():
    stats = TransferStats()
    link = SenderLink(TransceiverConfig(auth_token=TOKEN), "ctx-epoch", LAYOUT, stats)
    thread = SocketThread("test-sender", link)
    thread.start()
    dealer = shared_context().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(link.endpoint)
    yield link, thread, dealer, stats
    dealer.close(linger=0)
    thread.close()


def _reply(dealer: zmq.Socket, codec: SignedCodec, timeout_s: float = 5.0):
    assert dealer.poll(int(timeout_s * 1000)), "no reply"
    header, mac = dealer.recv_multipart()
    return codec.open(header, mac)


def _forged(version: int, ts: float) -> list[bytes]:
    enc = msgspec.msgpack.Encoder()
    env = Envelope(version=version, epoch="gen", seq=99, ts=ts, body=msgspec.Raw(enc.encode(Hello(layout=LAYOUT))))
    header = enc.encode(env)
    return [header, mac(link_codec(TOKEN.encode(), "gen", sender=False).send_key, header)]


def test_bad_messages_are_counted_and_the_next_good_one_is_answered(sender_link) -> None:
    link, thread, dealer, stats = sender_link
    assert link.endpoint.startswith("tcp://127.0.0.1:") and int(link.endpoint.rsplit(":", 1)[1]) > 0
    gen = link_codec(TOKEN.encode(), "gen-epoch", sender=False)
    hello = gen.seal(Hello(layout=LAYOUT))
    dealer.send_multipart([b"garbage"])  # one frame
    dealer.send_multipart([hello[0], b"\0" * 32])  # forged MAC
    dealer.send_multipart([hello[0][:-3], hello[1]])  # truncated header
    dealer.send_multipart([*hello, b"payload"])  # extra frame
    dealer.send_multipart(_forged(PROTOCOL_VERSION + 1, time.time()))
    dealer.send_multipart(_forged(PROTOCOL_VERSION, time.time() - 3600))
    dealer.send_multipart(link_codec(b"wrong-token-xxxxxxxx", "x", sender=False).seal(Hello(layout=LAYOUT)))
    dealer.send_multipart(hello)  # the good one
    epoch, info = _reply(dealer, gen)
    assert (epoch, info) == ("ctx-epoch", InstanceInfo(layout=LAYOUT))
    dealer.send_multipart(hello)  # replayed
    wait_until(lambda: stats.rejected_messages == 8, 5, "8 messages rejected")
    assert stats.rejected_by_reason == {"malformed": 2, "bad_mac": 3, "wrong_version": 1, "stale": 1,
                                        "replayed": 1}
    # replies come in order, so the next one is the answer to this pull (no lease: Failed), unless a
    # bad message was answered after all
    dealer.send_multipart(gen.seal(PullRequest(pull_id=77, ctx_request_id="none", ctx_epoch="ctx-epoch", ranges=[])))
    epoch, failed = _reply(dealer, gen)
    assert isinstance(failed, Failed) and (failed.pull_id, failed.reason) == (77, "unknown_request"), failed
    dealer.send_multipart(gen.seal(Hello(layout=LAYOUT)))
    assert _reply(dealer, gen) == ("ctx-epoch", InstanceInfo(layout=LAYOUT))


def test_oversized_message_is_cut_off_before_anything_reads_it(sender_link) -> None:
    _, thread, dealer, stats = sender_link
    gen = link_codec(TOKEN.encode(), "gen-epoch", sender=False)
    dealer.send_multipart(gen.seal(Hello(layout=LAYOUT)))
    assert _reply(dealer, gen)[0] == "ctx-epoch"  # connected: the next connection is a reconnection
    monitor = dealer.get_monitor_socket(zmq.EVENT_CONNECTED)
    try:
        dealer.send_multipart([b"x" * (1 << 20), b"\0" * 32])  # 1 MiB: zmq drops it and the connection
        assert monitor.poll(10_000), "the DEALER did not reconnect"
    finally:
        dealer.disable_monitor()
        monitor.close(linger=0)
    dealer.send_multipart(gen.seal(Hello(layout=LAYOUT)))
    assert _reply(dealer, gen) == ("ctx-epoch", InstanceInfo(layout=LAYOUT))
    assert stats.rejected_messages == 0 and thread.drain() == []


def test_incompatible_hello_is_refused_naming_the_difference(sender_link) -> None:
    _, _, dealer, _ = sender_link
    gen = link_codec(TOKEN.encode(), "gen-epoch", sender=False)
    other = Layout(tokens_per_block=8, fingerprint="fp", windows=LAYOUT.windows)
    dealer.send_multipart(gen.seal(Hello(layout=other)))
    _, failed = _reply(dealer, gen)
    assert failed == Failed(reason="incompatible", pull_id=None,
                            detail="incompatible peers: tokens_per_block differs: context 4 vs generation 8")


def _offer(thread: SocketThread) -> torch.Tensor:
    """Offer lease "r": blocks 0..2 in slots [5, 2, 7] of a 1 KiB-slot pool with a byte pattern."""
    pool = torch.arange(8 * 256, dtype=torch.int32).reshape(8, 256)  # [slots, 1 KiB]
    thread.submit(Offer("r", {128: OfferedWindow(pool, [5, 2, 7], 1024)}))
    return pool



def test_a_pull_is_served_by_the_socket_thread_and_the_lease_comes_back_once(sender_link) -> None:
    _, thread, dealer, stats = sender_link
    pool = _offer(thread)
    gen = link_codec(TOKEN.encode(), "gen-epoch", sender=False)
    dealer.send_multipart(gen.seal(PullRequest(pull_id=5, ctx_request_id="r", ctx_epoch="ctx-epoch",
                                               ranges=[WindowRange(window=128, first=1, count=2)])))
    assert dealer.poll(5000)
    header, mac, payload = dealer.recv_multipart()
    chunk = gen.open(header, mac)[1]
    part = np.frombuffer(payload, dtype=np.uint8)
    assert (chunk.first, chunk.count, chunk.nbytes) == (1, 2, 2048) and isinstance(chunk, ChunkHeader)
    assert payload == pool[2].numpy().tobytes() + pool[7].numpy().tobytes()  # blocks 1, 2 = slots 2, 7
    assert checksum([part], 1024, 1) == chunk.checksum
    assert _reply(dealer, gen)[1] == Done(pull_id=5, total_bytes=2048, chunks=1)
    assert delivered(thread, 1) == [Started("r")]
    dealer.send_multipart(gen.seal(Ack(pull_id=5, ctx_request_id="r")))
    assert delivered(thread, 1) == [Ended("r", [])]
    assert (stats.transfers_ok, stats.bytes_sent) == (1, 2048)
    thread.submit(Withdraw("r", "lease_expired", "late"))  # ended already: nothing more comes back
    dealer.send_multipart(gen.seal(PullRequest(pull_id=6, ctx_request_id="r", ctx_epoch="ctx-epoch", ranges=[])))
    failed = _reply(dealer, gen)[1]
    assert (failed.reason, failed.pull_id) == ("unknown_request", 6)
    assert thread.drain() == []


def test_a_withdrawn_lease_fails_its_pull_and_bad_ranges_are_refused(sender_link) -> None:
    _, thread, dealer, stats = sender_link
    _offer(thread)
    gen = link_codec(TOKEN.encode(), "gen-epoch", sender=False)
    dealer.send_multipart(gen.seal(PullRequest(pull_id=1, ctx_request_id="r", ctx_epoch="ctx-epoch",
                                               ranges=[WindowRange(window=128, first=2, count=2)])))
    refused = _reply(dealer, gen)[1]
    assert (refused.reason, refused.pull_id) == ("bad_request", 1) and "outside the lease" in refused.detail
    thread.submit(Withdraw("r", "lease_expired", "the lease expired"))
    assert delivered(thread, 1) == [Ended("r", [])]  # no pull ran: withdrawn quietly
    assert stats.failures_by_reason == {"bad_request": 1}


def test_sender_refuses_to_start_without_a_token() -> None:
    with pytest.raises(ValueError, match="auth_token is not set"):
        SenderLink(TransceiverConfig(), "e", LAYOUT, TransferStats())


def test_bind_failure_is_raised_by_start() -> None:
    taken = shared_context().socket(zmq.ROUTER)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    try:
        link = SenderLink(TransceiverConfig(auth_token=TOKEN, port=port), "e", LAYOUT, TransferStats())
        with pytest.raises(zmq.ZMQError):
            SocketThread("test-bind", link).start()
    finally:
        taken.close(linger=0)
