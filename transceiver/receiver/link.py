"""The generation side's socket thread: one DEALER per context endpoint, handshakes, message checks.

A pull waits until its endpoint answered a Hello from the pull's epoch (once per (endpoint, epoch));
another epoch (a restart) or an incompatible layout fails it unsent. Then it is planned (`_plan`,
tp.py): as it is with one rank on each side, else one part per context rank our kv heads come
from, with `Planned` reaching the engine before any chunk.

CUDA IPC: a new epoch's offer is opened once and handed over (`IpcPools`) before any pull of it goes
`via_ipc` (else: bytes); a new epoch without one, or an idle close, sends `IpcPools(..., None)`.
A monitor on each DEALER fails what depends on a lost peer at once (`PeerDown`, `PullRefused`).
`Probe`s shake hands before any request needs it; `peer_status` is read by /health.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from transceiver.config import TransceiverConfig
from transceiver.link import SocketIO
from transceiver.receiver.items import (
    IpcPools,
    PeerDown,
    Planned,
    Probe,
    Pull,
    PullRefused,
    Received,
    Send,
)
from transceiver.signed import Rejected
from transceiver.stats import TransferStats
from transceiver.tp import plan_parts
from transceiver.wire import (
    Cancel,
    ChunkHeader,
    Done,
    Failed,
    Hello,
    InstanceInfo,
    IpcChunk,
    IpcOffer,
    Layout,
    PeerIdentity,
    PullRequest,
    RankEndpoint,
    layout_mismatch,
    link_codec,
)

log = logging.getLogger(__name__)

HELLO_RETRY_S = 1.0  # resend an unanswered Hello (the peer may have been down or restarting)
PROBE_INTERVAL_S = 10.0  # at most one probing Hello per endpoint this often while it does not answer
PEER_COMPATIBLE = "compatible"
PEER_UNCHECKED = "unchecked"
PEER_UNREACHABLE = "unreachable"
INCOMPATIBLE = "incompatible"
IDLE_CLOSE_S = 600.0  # close a DEALER unused this long
MONITOR = "monitor"  # socket key (MONITOR, endpoint): the PAIR reading the DEALER's monitor events
_monitor_ids = itertools.count()  # inproc names are per zmq context, and the context is per process


@dataclass(frozen=True)
class _Waiting:
    request: PullRequest
    plan: bool  # a whole pull to plan once the peer answers (else a part, sent as it is)


@dataclass
class _Peer:
    epoch: str | None = None  # epoch of the last InstanceInfo answer
    info: InstanceInfo | None = None  # that answer
    hello_at: float | None = None  # when the pending Hello was sent (None: no handshake running)
    waiting: list[_Waiting] = field(default_factory=list)
    last_used: float = 0.0
    ipc_epoch: str | None = None  # the epoch whose pools are open (its pulls go with via_ipc)
    probed_at: float = float("-inf")  # when a probe last sent a Hello


class ReceiverLink:
    """LinkHandler of `KVReceiver`; socket keys are context endpoints."""

    def __init__(self, config: TransceiverConfig, epoch: str, layout: Layout, stats: TransferStats,
                 identity: PeerIdentity | None = None,
                 open_ipc: Callable[[IpcOffer], dict[int, Any]] | None = None) -> None:
        self._codec = link_codec(config.token_bytes(), epoch, sender=False)
        self._layout = layout
        self._stats = stats
        self._peers: dict[str, _Peer] = {}
        self._identity = identity  # None: never ask for IPC
        self._open_ipc = open_ipc
        self.peer_status: dict[str, str] = {}  # endpoint -> PEER_* or "incompatible: ...", read by /health

    def setup(self, io: SocketIO) -> None:
        return None

    def _peer(self, io: SocketIO, endpoint: str, now: float) -> _Peer:
        peer = self._peers.get(endpoint)
        if peer is None:
            sock = io.socket(endpoint, zmq.DEALER)
            sock.setsockopt(zmq.RCVHWM, 8)  # chunk messages are up to max_chunk_bytes each
            sock.setsockopt(zmq.SNDHWM, 1024)
            address = f"inproc://kv-receiver-monitor-{next(_monitor_ids)}"
            sock.monitor(address, zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED)
            io.socket((MONITOR, endpoint), zmq.PAIR).connect(address)
            sock.connect(endpoint)
            peer = self._peers[endpoint] = _Peer()
        peer.last_used = now
        return peer

    def on_command(self, io: SocketIO, cmd: Pull | Send | Probe) -> None:
        now = time.time()
        if isinstance(cmd, Probe):
            self._probe(io, cmd.endpoint, now)
            return
        peer = self._peer(io, cmd.endpoint, now)
        if isinstance(cmd, Send):
            if isinstance(cmd.body, Cancel) and cmd.body.pull_id is not None:
                peer.waiting = [w for w in peer.waiting if w.request.pull_id != cmd.body.pull_id]
            io.send(cmd.endpoint, self._codec.seal(cmd.body))
        else:
            self._route(io, cmd.endpoint, peer, _Waiting(cmd.request, plan=True), now)

    def _route(self, io: SocketIO, endpoint: str, peer: _Peer, item: _Waiting, now: float) -> None:
        """Plan or send `item` now if `endpoint` answered for its epoch, else after a handshake."""
        if peer.epoch == item.request.ctx_epoch:
            self._dispatch(io, endpoint, peer, item)
            return
        peer.waiting.append(item)
        if peer.hello_at is None:
            self._hello(io, endpoint, peer, now)

    def _dispatch(self, io: SocketIO, endpoint: str, peer: _Peer, item: _Waiting) -> None:
        if item.plan:
            self._plan(io, endpoint, peer, item.request)
        else:
            self._send_pull(io, endpoint, peer, item.request)

    def _plan(self, io: SocketIO, endpoint: str, peer: _Peer, req: PullRequest) -> None:
        """Cut the pull into one part per context rank our kv heads come from (transceiver/tp.py)."""
        assert peer.info is not None
        ranks = list(peer.info.ranks) or [RankEndpoint(endpoint, peer.info.layout.heads)]  # one unless TP
        try:
            parts = plan_parts(ranks, self._layout.heads)
        except ValueError as e:
            io.deliver(PullRefused(req.pull_id, INCOMPATIBLE, f"incompatible peers: {e}"))
            return
        if len(ranks) == 1 and self._layout.heads == (0, self._layout.total_heads):
            self._send_pull(io, endpoint, peer, req)  # one rank on each side: the pull as it is
            return
        # either side has more than one rank: the parts keep the lease, which ends with a `Release`
        ids = [req.pull_id] + [secrets.randbits(63) for _ in parts[1:]]
        io.deliver(Planned(req.pull_id, list(zip(ids, parts, strict=True)), req.ctx_request_id, req.ctx_epoch))
        now = time.time()
        for pull_id, part in zip(ids, parts, strict=True):
            part_req = msgspec.structs.replace(req, pull_id=pull_id, heads=part.src, keep_lease=True)
            if part.endpoint == endpoint:
                self._send_pull(io, endpoint, peer, part_req)
            else:
                self._route(io, part.endpoint, self._peer(io, part.endpoint, now), _Waiting(part_req, False), now)

    def _probe(self, io: SocketIO, endpoint: str, now: float) -> None:
        """A Hello without a pull, once per connection (a silent peer: at most every PROBE_INTERVAL_S)."""
        old = self._peers.get(endpoint)
        used = old.last_used if old is not None else now
        peer = self._peer(io, endpoint, now)
        peer.last_used = used  # probes alone do not keep a DEALER open (IDLE_CLOSE_S)
        self.peer_status.setdefault(endpoint, PEER_UNCHECKED)
        if peer.epoch is not None or peer.hello_at is not None or now - peer.probed_at < PROBE_INTERVAL_S:
            return
        peer.probed_at = now
        self._hello(io, endpoint, peer, now)

    def _peer_problem(self, endpoint: str, detail: str) -> None:
        self.peer_status[endpoint] = f"{INCOMPATIBLE}: {detail}"
        log.error("KV receiver: the context server at %s is incompatible: %s", endpoint, detail)

    def _hello(self, io: SocketIO, endpoint: str, peer: _Peer, now: float) -> None:
        peer.hello_at = now
        hello = Hello(layout=self._layout, identity=self._identity, open_epoch=peer.ipc_epoch)
        io.send(endpoint, self._codec.seal(hello))

    def _send_pull(self, io: SocketIO, endpoint: str, peer: _Peer, req: PullRequest) -> None:
        if peer.ipc_epoch == req.ctx_epoch and req.heads is None:
            req = msgspec.structs.replace(req, via_ipc=True)
        io.send(endpoint, self._codec.seal(req))

    def on_frames(self, io: SocketIO, key: Hashable, frames: list[zmq.Frame]) -> None:
        if isinstance(key, tuple):
            self._on_monitor(io, key[1], frames)
            return
        endpoint = str(key)
        if len(frames) < 2:
            self._stats.count_rejected("malformed")
            return
        try:
            epoch, body = self._codec.open(frames[0].bytes, frames[1].bytes)
        except Rejected as e:
            self._stats.count_rejected(e.reason)
            return
        payload = frames[2:]
        if payload and not isinstance(body, ChunkHeader):
            self._stats.count_rejected("malformed")
        elif isinstance(body, InstanceInfo):
            self._on_info(io, endpoint, epoch, body)
        elif isinstance(body, Failed) and body.pull_id is None:
            if body.reason == INCOMPATIBLE:
                self._peer_problem(endpoint, body.detail.removeprefix("incompatible peers: "))
            self._refuse_waiting(io, endpoint, body.reason, body.detail)
        elif isinstance(body, ChunkHeader | IpcChunk | Done | Failed):
            io.deliver(Received(endpoint, epoch, body, payload))
        else:
            self._stats.count_rejected("unexpected")

    def _on_info(self, io: SocketIO, endpoint: str, epoch: str, info: InstanceInfo) -> None:
        peer = self._peers.get(endpoint)
        if peer is None or peer.hello_at is None:
            return  # an answer to a Hello we no longer wait for
        problem = layout_mismatch(info.layout, self._layout)
        if problem is not None:
            self._peer_problem(endpoint, problem)
            self._refuse_waiting(io, endpoint, INCOMPATIBLE, f"incompatible peers: {problem}")
            return
        self.peer_status[endpoint] = PEER_COMPATIBLE
        if peer.epoch != epoch or peer.ipc_epoch != epoch:
            self._take_offer(io, endpoint, peer, epoch, info.ipc)
        peer.epoch, peer.info, peer.hello_at = epoch, info, None
        waiting, peer.waiting = peer.waiting, []
        for item in waiting:
            req = item.request
            if req.ctx_epoch == epoch:
                self._dispatch(io, endpoint, peer, item)
            else:
                io.deliver(PullRefused(req.pull_id, "epoch_mismatch", (
                    f"context server restarted: the request was prefilled by epoch {req.ctx_epoch}, "
                    f"{endpoint} now runs epoch {epoch}"
                )))

    def _take_offer(self, io: SocketIO, endpoint: str, peer: _Peer, epoch: str, offer: IpcOffer | None) -> None:
        """Open a new epoch's offered pools (or forget the old ones) before any pull of it is sent."""
        pools = None
        if offer is not None and self._open_ipc is not None and self._identity is not None \
                and offer.identity.shares_gpu_with(self._identity):
            try:
                pools = self._open_ipc(offer)
            except Exception as e:  # CUDA refused (container, driver, permissions): bytes it is
                self._stats.ipc_open_failures += 1
                log.warning("KV receiver: cannot open the CUDA IPC pools of %s (epoch %s), using the byte "
                            "path: %s", endpoint, epoch, e)
        if pools is not None or peer.ipc_epoch is not None:
            io.deliver(IpcPools(endpoint, epoch if pools is not None else None, pools))
        peer.ipc_epoch = epoch if pools is not None else None

    def _refuse_waiting(self, io: SocketIO, endpoint: str, reason: str, detail: str) -> None:
        peer = self._peers.get(endpoint)
        if peer is None:
            return
        waiting, peer.waiting, peer.hello_at = peer.waiting, [], None
        for item in waiting:
            io.deliver(PullRefused(item.request.pull_id, reason, detail))

    def _on_monitor(self, io: SocketIO, endpoint: str, frames: list[zmq.Frame]) -> None:
        event = parse_monitor_message([f.bytes for f in frames])["event"]
        peer = self._peers.get(endpoint)
        if peer is None:
            return
        if event == zmq.EVENT_DISCONNECTED:
            detail = f"the context server at {endpoint} is unreachable (connection lost)"
            peer.epoch = None  # whoever answers next must shake hands again
            io.deliver(PeerDown(endpoint, detail))
        elif event == zmq.EVENT_CONNECT_RETRIED:  # a connect attempt failed
            detail = f"the context server at {endpoint} is unreachable (connection refused)"
        else:
            return
        if endpoint in self.peer_status:
            self.peer_status[endpoint] = PEER_UNREACHABLE
        if peer.waiting:
            self._refuse_waiting(io, endpoint, "peer_gone", detail)

    def on_unroutable(self, io: SocketIO, key: Hashable, frames: list[Any]) -> None:
        return None  # DEALERs queue until connected; the monitor reports a peer that is gone

    def on_tick(self, io: SocketIO, now: float) -> None:
        for endpoint, peer in list(self._peers.items()):
            if peer.hello_at is not None and now - peer.hello_at >= HELLO_RETRY_S:
                if peer.waiting:
                    self._hello(io, endpoint, peer, now)
                else:
                    peer.hello_at = None
            elif not peer.waiting and now - peer.last_used > IDLE_CLOSE_S:
                io.close(endpoint)
                io.close((MONITOR, endpoint))
                del self._peers[endpoint]
                self.peer_status.pop(endpoint, None)
                if peer.ipc_epoch is not None:
                    io.deliver(IpcPools(endpoint, None, None))
