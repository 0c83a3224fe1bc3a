"""The rank channel: rank 0's ROUTER and one DEALER per other rank, on loopback.

Messages are signed and ordered: each carries the sender's count (exactly one more than the last),
its MAC binding it to the rank and direction (keys from rank 0's start-up secret). A failed check
raises `ChannelError` and the server stops. Each end is used by one thread only.
"""

from __future__ import annotations

import zmq

from server.tp.messages import Command, Report
from transceiver.signed import Rejected, SignedCodec

HOST = "127.0.0.1"
SEND_TIMEOUT_MS = 30_000  # a rank that stops reading for this long has failed


class ChannelError(RuntimeError):
    pass


def _codec(secret: bytes, root: bool) -> SignedCodec:
    sends, receives = ("command", "report") if root else ("report", "command")
    return SignedCodec(secret, "rank-channel", sends, receives, Report if root else Command, ordered=True)


def _open(codec: SignedCodec, peer: bytes, frames: list[bytes]):
    if len(frames) != 2:
        raise ChannelError(f"malformed message from {peer!r}")
    try:
        return codec.open(*frames, peer=peer)[1]
    except Rejected as exc:
        raise ChannelError(f"message from {peer!r} refused: {exc}") from None


def identity(rank: int) -> bytes:
    return f"rank-{rank}".encode()


def _socket(kind: int, *options: tuple[int, int | bytes]) -> zmq.Socket:
    sock = zmq.Context.instance().socket(kind)
    for option, value in ((zmq.LINGER, 0), (zmq.SNDTIMEO, SEND_TIMEOUT_MS), *options):
        sock.setsockopt(option, value)
    return sock


class RootEnd:
    """Rank 0's end: one command for every rank, reports from any."""

    def __init__(self, secret: bytes) -> None:
        self._codec = _codec(secret, root=True)  # a counter per rank, each way
        self._sock = _socket(zmq.ROUTER, (zmq.ROUTER_MANDATORY, 1))
        self._sock.bind(f"tcp://{HOST}:0")
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def send(self, ranks: list[int], command: Command) -> None:
        for rank in ranks:
            peer = identity(rank)
            try:
                self._sock.send_multipart([peer, *self._codec.seal(command, peer)])
            except zmq.ZMQError as exc:
                raise ChannelError(f"rank {rank} does not take commands: {exc}") from None

    def receive(self, timeout_s: float = 0.0) -> list[Report]:
        """Every report waiting (after at most `timeout_s` for the first)."""
        out = []
        timeout = int(timeout_s * 1000)
        while self._sock.poll(timeout):
            frames = self._sock.recv_multipart()
            out.append(_open(self._codec, frames[0], frames[1:]))
            timeout = 0
        return out

    def close(self) -> None:
        self._sock.close(linger=0)


class RankEnd:
    """The end of rank `rank` (>= 1): commands in, reports out."""

    def __init__(self, secret: bytes, endpoint: str, rank: int) -> None:
        self._codec = _codec(secret, root=False)
        self._identity = identity(rank)
        self._sock = _socket(zmq.DEALER, (zmq.IDENTITY, self._identity))
        self._sock.connect(endpoint)

    def report(self, report: Report) -> None:
        try:
            self._sock.send_multipart(self._codec.seal(report, self._identity))
        except zmq.ZMQError as exc:
            raise ChannelError(f"rank 0 does not take reports: {exc}") from None

    def receive(self, timeout_s: float) -> Command | None:
        if not self._sock.poll(int(timeout_s * 1000)):
            return None
        return _open(self._codec, self._identity, self._sock.recv_multipart())

    def close(self) -> None:
        self._sock.close(linger=0)
