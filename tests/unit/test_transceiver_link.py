"""The context side's socket thread on real loopback sockets: bad messages are dropped and counted
without stalling it, handshakes are answered, engine-bound messages reach the engine queue."""

from __future__ import annotations

import hashlib
import hmac
import time

import msgspec
import pytest
import zmq

from transceiver.codec import Codec
from transceiver.config import TransceiverConfig
from transceiver.link import SocketThread, shared_context
from transceiver.messages import (
    PROTOCOL_VERSION,
    Envelope,
    Failed,
    Hello,
    InstanceInfo,
    Layout,
    PullRequest,
    WindowLayout,
)
from transceiver.sender_link import Incoming, SenderLink
from transceiver.stats import TransferStats

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


def _reply(dealer: zmq.Socket, codec: Codec, timeout_s: float = 5.0):
    assert dealer.poll(int(timeout_s * 1000)), "no reply"
    header, mac = dealer.recv_multipart()
    return codec.open(header, mac)


def _wait_for(cond, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def _forged(version: int, ts: float) -> list[bytes]:
    enc = msgspec.msgpack.Encoder()
    env = Envelope(version=version, sender_epoch="gen", msg_id=99, ts=ts,
                   body=msgspec.Raw(enc.encode(Hello(layout=LAYOUT))))
    header = enc.encode(env)
    return [header, hmac.new(TOKEN.encode(), header, hashlib.sha256).digest()]


def test_bad_messages_are_counted_and_the_next_good_one_is_answered(sender_link) -> None:
    link, thread, dealer, stats = sender_link
    assert link.endpoint.startswith("tcp://127.0.0.1:") and int(link.endpoint.rsplit(":", 1)[1]) > 0
    gen = Codec(TOKEN.encode(), "gen-epoch")
    hello = gen.seal(Hello(layout=LAYOUT))
    dealer.send_multipart([b"garbage"])  # one frame
    dealer.send_multipart([hello[0], b"\0" * 32])  # forged MAC
    dealer.send_multipart([hello[0][:-3], hello[1]])  # truncated header
    dealer.send_multipart([*hello, b"payload"])  # extra frame
    dealer.send_multipart(_forged(PROTOCOL_VERSION + 1, time.time()))
    dealer.send_multipart(_forged(PROTOCOL_VERSION, time.time() - 3600))
    dealer.send_multipart(Codec(b"wrong-token-xxxxxxxx", "x").seal(Hello(layout=LAYOUT)))
    dealer.send_multipart(hello)  # the good one
    epoch, info = _reply(dealer, gen)
    assert (epoch, info) == ("ctx-epoch", InstanceInfo(layout=LAYOUT))
    dealer.send_multipart(hello)  # replayed
    _wait_for(lambda: stats.rejected_messages == 8)
    assert stats.rejected_by_reason == {"malformed": 2, "bad_mac": 3, "wrong_version": 1, "stale": 1,
                                        "replayed": 1}
    assert dealer.poll(200) == 0  # nothing answered the bad ones
    dealer.send_multipart(gen.seal(Hello(layout=LAYOUT)))
    assert _reply(dealer, gen) == ("ctx-epoch", InstanceInfo(layout=LAYOUT))


def test_oversized_message_is_cut_off_before_anything_reads_it(sender_link) -> None:
    _, thread, dealer, stats = sender_link
    gen = Codec(TOKEN.encode(), "gen-epoch")
    dealer.send_multipart([b"x" * (1 << 20), b"\0" * 32])  # 1 MiB: zmq drops it and the connection
    time.sleep(0.2)
    dealer.send_multipart(gen.seal(Hello(layout=LAYOUT)))  # the DEALER has reconnected by now
    assert _reply(dealer, gen) == ("ctx-epoch", InstanceInfo(layout=LAYOUT))
    assert stats.rejected_messages == 0 and thread.drain() == []


def test_incompatible_hello_is_refused_naming_the_difference(sender_link) -> None:
    _, _, dealer, _ = sender_link
    gen = Codec(TOKEN.encode(), "gen-epoch")
    other = Layout(tokens_per_block=8, fingerprint="fp", windows=LAYOUT.windows)
    dealer.send_multipart(gen.seal(Hello(layout=other)))
    _, failed = _reply(dealer, gen)
    assert failed == Failed(reason="incompatible", pull_id=None,
                            detail="incompatible peers: tokens_per_block differs: context 4 vs generation 8")


def test_engine_messages_reach_the_engine_queue(sender_link) -> None:
    _, thread, dealer, _ = sender_link
    pull = PullRequest(pull_id=5, ctx_request_id="r", ctx_epoch="ctx-epoch", ranges=[])
    dealer.send_multipart(Codec(TOKEN.encode(), "gen-epoch").seal(pull))
    assert thread.wait(5.0)
    [item] = thread.drain()
    assert isinstance(item, Incoming) and (item.sender_epoch, item.body) == ("gen-epoch", pull)
    assert thread.drain() == []


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
