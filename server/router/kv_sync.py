"""The router's side of the KV events: one subscriber socket thread, one `KvFeed` per server.

The socket thread owns one DEALER per server, connected to the address the server gives (`GET
/kv_cache/events`, with the token; never an address from a request), and checks every message
before handing it to the event loop. The event loop runs the feeds, the snapshot fetches and a
maintenance round every ROUND_S (subscribe to healthy servers, drop fenced ones, restart quiet feeds)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

import zmq
from prometheus_client import CollectorRegistry, Counter, Gauge

from kvcache import Level
from server.auth import token_headers
from server.router.backends import Backend
from server.router.http_client import HttpClient, HttpError
from server.router.kv_feed import KvFeed
from server.telemetry.kv_events import HEARTBEAT_S, SUBSCRIBE_EVERY_S, KvEventBatch, Subscribe, event_codec
from transceiver.link import SocketIO, SocketThread
from transceiver.signed import Rejected, SignedCodec

log = logging.getLogger(__name__)

ROUND_S = 0.5
QUIET_S = 5 * HEARTBEAT_S  # no batch for this long: the feed is restarted
HTTP_TIMEOUT_S = 15.0


class _Subscriber:
    """Socket thread handler: a DEALER per server url."""

    def __init__(self, codec: SignedCodec) -> None:
        self._codec = codec
        self._last_subscribe: dict[str, float] = {}

    def setup(self, io: SocketIO) -> None:
        return None

    def on_command(self, io: SocketIO, cmd: tuple[str, str, str]) -> None:
        verb, url, endpoint = cmd
        io.close(url)
        self._last_subscribe.pop(url, None)
        if verb == "connect":
            sock = io.socket(url, zmq.DEALER)
            sock.setsockopt(zmq.RCVHWM, 1000)
            sock.setsockopt(zmq.MAXMSGSIZE, 64 * 1024)
            sock.connect(endpoint)
            self._subscribe(io, url)

    def on_frames(self, io: SocketIO, url: str, frames: list) -> None:
        try:
            if len(frames) != 2:
                raise Rejected("malformed")
            epoch, body = self._codec.open(frames[0].bytes, frames[1].bytes)
        except Rejected as exc:
            log.warning("KV events from %s: dropped a message (%s)", url, exc.reason)
            return
        if isinstance(body, KvEventBatch):
            io.deliver((url, epoch, body))

    def on_unroutable(self, io: SocketIO, key, frames: list) -> None:
        return None

    def on_tick(self, io: SocketIO, now: float) -> None:
        for url, last in list(self._last_subscribe.items()):
            if time.monotonic() - last >= SUBSCRIBE_EVERY_S:
                self._subscribe(io, url)

    def _subscribe(self, io: SocketIO, url: str) -> None:
        io.send(url, self._codec.seal(Subscribe()))
        self._last_subscribe[url] = time.monotonic()


class KvEventSync:
    """Keeps `backend.kv_index` of every backend right from its events (start/stop in the lifespan)."""

    def __init__(self, backends: Sequence[Backend], client: HttpClient, token: str,
                 registry: CollectorRegistry) -> None:
        self.backends = list(backends)
        self.feeds = {b.url: KvFeed(index=b.kv_index) for b in self.backends}
        self._client, self._headers = client, token_headers(token)
        self._thread = SocketThread("pdserve-router-kv-events", _Subscriber(event_codec(token, publisher=False)),
                                    inbox_size=4096, tick_s=0.25, notify=self._notify)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._busy: set[str] = set()  # urls with a subscribe or snapshot request in flight
        self._heard: dict[str, float] = {}
        self._counted: dict[tuple[str, str], int] = {}
        self._events = Counter("pdserve_router_kv_events", "KV events applied to the router's index, by server",
                               ["server"], registry=registry)
        self._resyncs = Counter("pdserve_router_kv_resyncs", "Resynchronisations of a server's KV index from "
                                "a snapshot after a gap or a restart, by reason", ["server", "reason"],
                                registry=registry)
        self._blocks = Gauge("pdserve_router_kv_index_blocks", "Blocks in the router's index of a server's "
                             "cache, by window and tier", ["server", "window", "tier"], registry=registry)
        self._live = Gauge("pdserve_router_kv_feed_live", "1 while the server's KV event feed is in sync",
                           ["server"], registry=registry)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await asyncio.to_thread(self._thread.start)
        self._task = asyncio.create_task(self._rounds())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await asyncio.to_thread(self._thread.close)

    # ---- the event loop's side
    def _notify(self) -> None:  # socket thread
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        for url, epoch, batch in self._thread.drain():
            feed = self.feeds.get(url)
            if feed is None:
                continue
            self._heard[url] = time.monotonic()
            applied = feed.events_applied
            if feed.on_batch(epoch, batch):
                self._fetch_snapshot(url)
            self._events.labels(url).inc(feed.events_applied - applied)

    async def _rounds(self) -> None:
        while True:
            try:
                self.round()
            except Exception:  # a bug here must not stop the feeds for good
                log.exception("KV event sync round failed")
            await asyncio.sleep(ROUND_S)

    def round(self) -> None:
        now = time.monotonic()
        for backend in self.backends:
            url, feed = backend.url, self.feeds[backend.url]
            if not backend.healthy:
                if feed.state != "idle":
                    self._restart(url, "fenced")
                continue
            quiet = now - self._heard.get(url, now) > QUIET_S
            if feed.state != "idle" and quiet and url not in self._busy:
                self._restart(url, "quiet")
            if feed.state == "idle" and url not in self._busy:
                self._spawn(url, self._subscribe(url))
            elif feed.state == "syncing":  # a snapshot asked for while a request was in flight
                self._fetch_snapshot(url)
            self._export(url, feed)

    def _restart(self, url: str, reason: str) -> None:
        log.info("KV event feed of %s restarts (%s)", url, reason)
        self.feeds[url].stop()
        self._heard.pop(url, None)
        self._thread.submit(("close", url, ""))

    async def _subscribe(self, url: str) -> None:
        try:
            response = await self._client.request("GET", f"{url}/kv_cache/events", headers=self._headers,
                                                  timeout=HTTP_TIMEOUT_S)
            endpoint = response.json()["endpoint"] if response.status == 200 else None
        except (HttpError, ValueError, KeyError, TypeError) as exc:
            log.warning("KV events of %s: no endpoint (%s)", url, exc)
            return
        if not isinstance(endpoint, str):
            log.warning("KV events of %s: GET /kv_cache/events answered %s", url, response.status)
            return
        self.feeds[url].subscribed()
        self._heard[url] = time.monotonic()
        self._thread.submit(("connect", url, endpoint))

    def _fetch_snapshot(self, url: str) -> None:
        if url not in self._busy:
            self._spawn(url, self._snapshot(url))

    async def _snapshot(self, url: str) -> None:
        feed = self.feeds[url]
        while feed.state == "syncing":
            try:
                response = await self._client.request("GET", f"{url}/kv_cache/hashes", headers=self._headers,
                                                      timeout=HTTP_TIMEOUT_S)
                if response.status != 200:
                    raise ValueError(f"HTTP {response.status}")
                again = feed.on_snapshot(response.json())
            except (HttpError, ValueError, KeyError, TypeError) as exc:
                log.warning("KV index of %s: snapshot failed (%s); the feed restarts", url, exc)
                self._restart(url, "snapshot_failed")
                return
            if not again:
                return

    def _spawn(self, url: str, work) -> None:
        self._busy.add(url)
        task = asyncio.ensure_future(work)
        task.add_done_callback(lambda _: self._busy.discard(url))

    def _export(self, url: str, feed: KvFeed) -> None:
        self._live.labels(url).set(1 if feed.state == "live" else 0)
        for reason, count in feed.resyncs.items():
            seen = self._counted.get((url, reason), 0)
            if count > seen:
                self._resyncs.labels(url, reason).inc(count - seen)
                self._counted[url, reason] = count
        for window in feed.index.windows:
            for level in Level:
                self._blocks.labels(url, str(window), level.name.lower()).set(feed.index.counts.get((window, level), 0))
