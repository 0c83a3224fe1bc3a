"""The KV events channel over real ZeroMQ sockets on loopback: a subscriber with the deployment token
gets a heartbeat at once, then every batch in order (a long one cut into numbered messages); one
with another token gets nothing, and the publisher counts its Subscribe as rejected."""

from __future__ import annotations

import time

from server.kv_events import MAX_EVENTS_PER_MESSAGE, EventCodec, KvEventBatch, KvEventPublisher
from server.router.kv_sync import _Subscriber
from transceiver.link import SocketThread

TOKEN = "a-deployment-token-of-enough-length"
URL = "http://127.0.0.1:1"


def _subscriber(token: str) -> SocketThread:
    thread = SocketThread("test-kv-sub", _Subscriber(EventCodec(token, "router")), tick_s=0.05)
    thread.start()
    return thread


def _collect(thread: SocketThread, want: int, timeout_s: float = 10.0) -> list:
    got, deadline = [], time.monotonic() + timeout_s
    while len(got) < want and time.monotonic() < deadline:
        if thread.wait(0.1):
            got += thread.drain()
    return got


def test_subscriber_gets_heartbeat_then_numbered_batches():
    publisher = KvEventPublisher(TOKEN, "epoch-a", "127.0.0.1")
    publisher.start()
    thread = _subscriber(TOKEN)
    try:
        thread.submit(("connect", URL, publisher.endpoint))
        [(url, epoch, hello)] = _collect(thread, 1)
        assert (url, epoch, hello) == (URL, "epoch-a", KvEventBatch(1, []))
        events = [(64, 0, bytes([i % 256]) * 16, 0) for i in range(MAX_EVENTS_PER_MESSAGE + 5)]
        publisher.publish(1, events)
        publisher.publish(len(events) + 1, [(64, 1, b"\x01" * 16, 0)])
        got = [b for _, _, b in _collect(thread, 3) if b.events]  # heartbeats may come in between
        assert [(b.first_seq, len(b.events)) for b in got] == [(1, MAX_EVENTS_PER_MESSAGE),
                                                               (MAX_EVENTS_PER_MESSAGE + 1, 5),
                                                               (len(events) + 1, 1)]
        assert [tuple(e) for b in got[:2] for e in b.events] == events
    finally:
        thread.close()
        publisher.close()


def test_a_subscriber_without_the_token_gets_nothing():
    publisher = KvEventPublisher(TOKEN, "epoch-a", "127.0.0.1")
    publisher.start()
    thread = _subscriber("another-token-of-sufficient-length")
    try:
        thread.submit(("connect", URL, publisher.endpoint))
        deadline = time.monotonic() + 10
        while publisher._handler.rejected == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert publisher._handler.rejected >= 1 and publisher._handler.subscribers == {}
        publisher.publish(1, [(64, 0, b"\x02" * 16, 0)])
        assert _collect(thread, 1, timeout_s=1.5) == []
    finally:
        thread.close()
        publisher.close()
