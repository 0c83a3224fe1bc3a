"""The KV events channel over real ZeroMQ sockets on loopback: a subscriber with the deployment token
gets a heartbeat at once, then every batch in order (a long one cut into numbered messages); one
with another token gets nothing, and the publisher counts its Subscribe as rejected."""

from __future__ import annotations

from waiting import wait_until

from server.router.kv_sync import _Subscriber
from server.telemetry.kv_events import MAX_EVENTS_PER_MESSAGE, KvEventBatch, KvEventPublisher, event_codec
from transceiver.link import SocketThread

TOKEN = "a-deployment-token-of-enough-length"
URL = "http://127.0.0.1:1"


def _subscriber(token: str) -> SocketThread:
    thread = SocketThread("test-kv-sub", _Subscriber(event_codec(token, publisher=False)), tick_s=0.05)
    thread.start()
    return thread


def _collect(thread: SocketThread, want: int, timeout_s: float = 10.0, events_only: bool = False) -> list:
    """What the subscriber handed over once `want` items came (with `events_only`: batches with events,
    heartbeats left out)."""
    got: list = []

    def enough() -> bool:
        got.extend(item for item in thread.drain() if not events_only or item[2].events)
        return len(got) >= want

    wait_until(enough, timeout_s, f"{want} item(s) from the subscriber", step=lambda: thread.wait(0.1),
               on_timeout=lambda: f"got {got}")
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
        got = [b for _, _, b in _collect(thread, 3, events_only=True)]  # heartbeats may come in between
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
    marker = _subscriber(TOKEN)  # a subscriber with the token: what it gets, the other one could have got
    try:
        thread.submit(("connect", URL, publisher.endpoint))
        wait_until(lambda: publisher.rejected, 10, "the Subscribe without the token rejected")
        assert publisher.subscribers == {}
        marker.submit(("connect", "http://127.0.0.1:2", publisher.endpoint))
        _collect(marker, 1)  # its heartbeat: subscribed
        for seq in (1, 2):
            publisher.publish(seq, [(64, 0, bytes([seq]) * 16, 0)])
            _collect(marker, 1, events_only=True)
        assert thread.drain() == []  # both batches reached the marker; nothing reached this one
    finally:
        marker.close()
        thread.close()
        publisher.close()
