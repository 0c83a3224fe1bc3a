"""KV events: an engine server tells its router which blocks its reuse cache gained, lost or moved.

Engine thread (`KvEventSource.on_tick`): drain the KV manager's events, number them per process and
hand the batch to the publisher thread (no socket work, no encoding); the same hook builds the
snapshots `GET /kv_cache/hashes` asks for, so a snapshot is exactly the state after event `seq`.
Publisher thread (`KvEventPublisher`): a ROUTER socket that sends each batch to every subscriber heard
from within SUBSCRIBER_TTL_S, and a heartbeat every HEARTBEAT_S. A subscriber that misses messages
sees the gap in sequence numbers and resynchronises from a snapshot. Messages are signed with keys
derived from the deployment token (`event_codec`); nothing is ever unpickled."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from contextlib import suppress

import msgspec
import zmq

from kvcache import Level
from transceiver.link import SocketIO, SocketThread
from transceiver.signed import Rejected, SignedCodec

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
SUBSCRIBE_EVERY_S = 2.0  # a subscriber repeats Subscribe this often
SUBSCRIBER_TTL_S = 3 * SUBSCRIBE_EVERY_S + 1.0
MAX_EVENTS_PER_MESSAGE = 1000  # ~30 kB: well under MAX_MESSAGE_BYTES
MAX_MESSAGE_BYTES = 64 * 1024
SNAPSHOT_TIMEOUT_S = 10.0
SOCKET = "events"

KvEvent = tuple[int, int, bytes, int]  # (window, kind, block hash, level): kvcache/events.py


class Subscribe(msgspec.Struct, tag=True, frozen=True):
    """Subscriber -> publisher: send me the batches (repeated every SUBSCRIBE_EVERY_S)."""


class KvEventBatch(msgspec.Struct, tag=True, frozen=True):
    """Publisher -> subscriber: events numbered first_seq, first_seq + 1, ...; without events, a
    heartbeat whose first_seq is the number the next event will get."""

    first_seq: int
    events: list[tuple[int, int, bytes, int]]
    kv_dtype: str = ""  # the element type of the publisher's KV blocks ("float8_e4m3fn", "bfloat16", ...)


def event_codec(token: str, *, publisher: bool, epoch: str = "") -> SignedCodec:
    """One end of the events channel: the server's publisher (with its `epoch`) or the router's subscriber."""
    sends, receives = ("batches", "subscribes") if publisher else ("subscribes", "batches")
    return SignedCodec(token.encode(), "kv-events", sends, receives, Subscribe if publisher else KvEventBatch,
                       epoch=epoch, fresh=True, max_bytes=MAX_MESSAGE_BYTES)


def message_batches(first_seq: int, events: list[KvEvent], kv_dtype: str = "") -> list[KvEventBatch]:
    """`events` cut into messages of at most MAX_EVENTS_PER_MESSAGE, numbered on."""
    return [KvEventBatch(first_seq + i, events[i:i + MAX_EVENTS_PER_MESSAGE], kv_dtype)
            for i in range(0, len(events), MAX_EVENTS_PER_MESSAGE)]


class KvEventPublisher:
    """Owns the publisher thread and is its handler: one ROUTER socket, the subscribers heard from
    lately. `publish` (engine thread) never blocks."""

    def __init__(self, token: str, epoch: str, host: str, kv_dtype: str = "") -> None:
        self._codec = event_codec(token, publisher=True, epoch=epoch)
        self._host = host
        self.kv_dtype = kv_dtype
        self.endpoint = ""
        self.next_seq = 1  # the number the next event sent will have (heartbeats carry it)
        self.subscribers: dict[bytes, float] = {}  # peer identity -> last Subscribe (monotonic)
        self.rejected = 0
        self._last_beat = 0.0
        self._thread = SocketThread("pdserve-kv-events", self, tick_s=0.25)

    def start(self) -> None:
        self._thread.start()

    def publish(self, first_seq: int, events: list[KvEvent]) -> None:
        with suppress(RuntimeError, ValueError):  # queue full or thread gone: subscribers see the gap
            self._thread.submit((first_seq, events), timeout_s=0)

    def close(self) -> None:
        self._thread.close()

    def setup(self, io: SocketIO) -> None:
        sock = io.socket(SOCKET, zmq.ROUTER)  # not ROUTER_MANDATORY: a message to a gone peer is dropped
        sock.setsockopt(zmq.SNDHWM, 1000)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.bind(f"tcp://{self._host}:*")
        self.endpoint = f"tcp://{self._host}:{sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(':', 1)[1]}"

    def on_command(self, io: SocketIO, cmd: tuple[int, list[KvEvent]]) -> None:
        first_seq, events = cmd
        for batch in message_batches(first_seq, events, self.kv_dtype):
            self._broadcast(io, batch)
        self.next_seq = first_seq + len(events)

    def on_frames(self, io: SocketIO, key, frames: list) -> None:
        if len(frames) != 3:
            self.rejected += 1
            return
        peer = frames[0].bytes
        try:
            _, body = self._codec.open(frames[1].bytes, frames[2].bytes)
        except Rejected as exc:
            self.rejected += 1
            log.warning("KV events: dropped a message (%s)", exc.reason)
            return
        if isinstance(body, Subscribe):
            if peer not in self.subscribers:
                io.send(SOCKET, [peer, *self._codec.seal(self._beat())])  # tells it where the numbers stand
            self.subscribers[peer] = time.monotonic()

    def on_unroutable(self, io: SocketIO, key, frames: list) -> None:
        return None

    def on_tick(self, io: SocketIO, now: float) -> None:
        mono = time.monotonic()
        for peer, seen in list(self.subscribers.items()):
            if mono - seen > SUBSCRIBER_TTL_S:
                del self.subscribers[peer]
        if mono - self._last_beat >= HEARTBEAT_S:
            self._broadcast(io, self._beat())

    def _beat(self) -> KvEventBatch:
        return KvEventBatch(self.next_seq, [], self.kv_dtype)

    def _broadcast(self, io: SocketIO, batch: KvEventBatch) -> None:
        self._last_beat = time.monotonic()
        if self.subscribers:
            sealed = self._codec.seal(batch)
            for peer in self.subscribers:
                io.send(SOCKET, [peer, *sealed])


class KvEventSource:
    """The engine thread's side: events out every tick, snapshots on request (any thread asks)."""

    def __init__(self, publisher: KvEventPublisher | None, epoch: str) -> None:
        self.publisher = publisher  # None: no events (a server without the deployment token)
        self.epoch = epoch
        self.seq = 0  # the number of the last event drained (the state a snapshot now shows)
        self.wake: Callable[[], None] = lambda: None  # ends the engine loop's idle wait (its port's wake)
        self._wanted: list[concurrent.futures.Future] = []
        self._lock = threading.Lock()

    def attach(self, kv) -> None:
        """Engine thread, before the first step: the KV manager records events from its first block on."""
        if self.publisher is not None:
            kv.enable_events()

    def on_tick(self, core) -> None:
        """Engine thread, after every step."""
        if self.publisher is not None:
            events = core.kv.drain_events()
            if events:
                self.publisher.publish(self.seq + 1, events)
                self.seq += len(events)
        if self._wanted:
            with self._lock:
                wanted, self._wanted = self._wanted, []
            wanted = [f for f in wanted if f.set_running_or_notify_cancel()]  # not given up on
            try:
                snapshot = self._snapshot(core.kv)
            except Exception as exc:  # a broken snapshot fails its askers, never the engine thread
                log.exception("KV cache snapshot failed")
                for future in wanted:
                    future.set_exception(exc)
                return
            for future in wanted:
                future.set_result(snapshot)

    def request_snapshot(self) -> concurrent.futures.Future:
        """Any thread: a future the engine thread's next tick completes with the snapshot: the cache's
        blocks per window and level, and the `seq` of the last event they include."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._wanted.append(future)
        self.wake()  # an idle engine thread ticks at once
        return future

    def _snapshot(self, kv) -> dict:
        blocks = kv.cached_blocks()
        largest = blocks[max(blocks)]
        return {
            "salt": kv.salt, "tokens_per_block": kv.tokens_per_block, "epoch": self.epoch, "seq": self.seq,
            "kv_dtype": str(kv.layout.format.dtype).removeprefix("torch."),
            # the snapshot policy's view (kv_cache_snapshot): the largest window, any level
            "hashes": [h.hex() for level in Level for h in largest[level]],
            "windows": {str(w): {level.name.lower(): [h.hex() for h in hashes] for level, hashes in levels.items()}
                        for w, levels in blocks.items()},
        }
