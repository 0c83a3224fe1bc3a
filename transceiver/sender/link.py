"""The context side's socket thread: one ROUTER, message checks, handshakes, and the pulls (served by
`PullServer` from the engine's `Offer`s). A Hello is answered here, except from a receiver on our GPU
without this epoch's pools: the engine exports them and answers with `Outgoing` (sealed here, fresh).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import zmq

from transceiver.config import TransceiverConfig
from transceiver.link import SocketIO
from transceiver.sender.lease import Extend, Offer, Withdraw
from transceiver.sender.serve import PullServer
from transceiver.signed import Rejected
from transceiver.stats import TransferStats
from transceiver.wire import (
    Ack,
    Body,
    Cancel,
    Failed,
    Hello,
    InstanceInfo,
    Layout,
    PeerIdentity,
    PullRequest,
    RankEndpoint,
    Release,
    layout_mismatch,
    link_codec,
)

ROUTER = "router"
MAX_INCOMING_BYTES = 64 * 1024  # receivers send only small control messages


@dataclass(frozen=True)
class Outgoing:
    """The engine's answer to an `ExportRequest`, sealed and sent here."""

    peer: bytes
    body: Body


@dataclass(frozen=True)
class ExportRequest:
    """A receiver on our GPU said Hello: the engine (where `_share_cuda_` must run) exports the pools
    and sends `info` with the offer."""

    peer: bytes
    info: InstanceInfo  # the answer, without the offer


class SenderLink:
    """LinkHandler of `KVSender`."""

    def __init__(self, config: TransceiverConfig, epoch: str, layout: Layout, stats: TransferStats,
                 ipc_identity: PeerIdentity | None = None, *, pool_lock: threading.Lock | None = None,
                 ipc_offered: Callable[[], bool] = lambda: False,
                 other_ranks: list[RankEndpoint] | None = None, park_s: float = 0.0) -> None:
        """`other_ranks`: rank 0 of a tensor-parallel server lists them in its handshakes; `park_s`:
        another rank's sender lets a pull wait that long for its lease (`PullServer`)."""
        self._config = config
        self._other_ranks = other_ranks or []
        self._ranks: list[RankEndpoint] = []
        self._codec = link_codec(config.token_bytes(), epoch, sender=True)
        self._layout = layout
        self._ipc_identity = ipc_identity  # None: this sender serves bytes only
        self._stats = stats
        self._io: SocketIO | None = None
        self.endpoint = ""
        self._server = PullServer(config, epoch, stats, self._send, pool_lock or threading.Lock(), ipc_offered,
                                  park_s)

    def setup(self, io: SocketIO) -> None:
        self._io = io
        sock = io.socket(ROUTER, zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unroutable -> error, never a silent drop
        sock.setsockopt(zmq.SNDHWM, 64)
        sock.setsockopt(zmq.RCVHWM, 1024)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_INCOMING_BYTES)  # zmq disconnects a peer that sends more
        port = self._config.port or "*"
        sock.bind(f"tcp://{self._config.host}:{port}")
        bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)  # tcp://host:port
        self.endpoint = f"tcp://{self._config.host}:{bound.rsplit(':', 1)[1]}"
        if self._other_ranks:
            self._ranks = [RankEndpoint(self.endpoint, self._layout.heads), *self._other_ranks]

    def has_pending_sends(self) -> bool:
        return self._io is not None and self._io.held_back

    def _send(self, io: SocketIO, peer: bytes, body: Body, payload: list[Any]) -> None:
        io.send(ROUTER, [peer, *self._codec.seal(body), *payload])

    def on_command(self, io: SocketIO, cmd: Outgoing | Offer | Extend | Withdraw) -> None:
        if isinstance(cmd, Offer):
            self._server.offer(cmd, io)
        elif isinstance(cmd, Extend):
            self._server.extend(io, cmd)
        elif isinstance(cmd, Withdraw):
            self._server.withdraw(io, cmd)
        else:
            self._send(io, cmd.peer, cmd.body, [])

    def pump(self, io: SocketIO) -> float | None:
        return self._server.pump(io)

    def on_frames(self, io: SocketIO, key: Hashable, frames: list[zmq.Frame]) -> None:
        if len(frames) != 3:  # identity, header, mac: receivers never send payload
            self._stats.count_rejected("malformed")
            return
        peer = frames[0].bytes
        try:
            epoch, body = self._codec.open(frames[1].bytes, frames[2].bytes)
        except Rejected as e:
            self._stats.count_rejected(e.reason)
            return
        if isinstance(body, Hello):
            self._on_hello(io, peer, body)
        elif isinstance(body, PullRequest):
            self._server.pull(io, peer, body)
        elif isinstance(body, Ack):
            self._server.ack(io, body)
        elif isinstance(body, Cancel):
            self._server.cancel(io, peer, body)
        elif isinstance(body, Release):
            self._server.release(io, body)
        else:
            self._stats.count_rejected("unexpected")

    def _on_hello(self, io: SocketIO, peer: bytes, hello: Hello) -> None:
        problem = layout_mismatch(self._layout, hello.layout)
        info = InstanceInfo(layout=self._layout, ranks=self._ranks)
        if problem is not None:
            self._send(io, peer, Failed(reason="incompatible", detail=f"incompatible peers: {problem}"), [])
        elif self._ipc_identity is not None and hello.identity is not None and hello.open_epoch != self._codec.epoch \
                and self._ipc_identity.shares_gpu_with(hello.identity):  # the engine exports the pools for it
            io.deliver(ExportRequest(peer, info))
        else:
            self._send(io, peer, info, [])

    def on_unroutable(self, io: SocketIO, key: Hashable, frames: list[Any]) -> None:
        peer = frames[0]
        self._server.peer_gone(io, peer.bytes if isinstance(peer, zmq.Frame) else bytes(peer))

    def on_tick(self, io: SocketIO, now: float) -> None:
        self._server.expire_parked(io)
