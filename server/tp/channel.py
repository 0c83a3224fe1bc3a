"""The rank channel: rank 0's ROUTER and one DEALER per other rank, on loopback.

A message is `[seq, payload, mac]`: `seq` the sender's 8-byte little-endian message counter, which
must be exactly one more than the last one received from that peer (nothing replayed, dropped or
reordered goes unnoticed), `payload` msgspec msgpack (never pickle) and `mac` HMAC-SHA256 over the
rank's channel identity, the direction and both, with the server's own secret, which rank 0 draws at
start and hands to the ranks it spawns (so no rank's message passes for another's). A
message that fails a check raises `ChannelError`: the ranks no longer agree, and the server stops.
Each end is used by one thread only (rank 0's engine thread; a rank's main loop).
"""

from __future__ import annotations

import hashlib
import hmac
import struct

import msgspec
import zmq

from server.tp.messages import Command, Report

HOST = "127.0.0.1"
SEND_TIMEOUT_MS = 30_000  # a rank that stops reading for this long has failed


class ChannelError(RuntimeError):
    pass


class _Codec:
    """One end's sealing (`outgoing` direction label) and opening, with a counter per peer."""

    def __init__(self, secret: bytes, incoming: type, outgoing: bytes) -> None:
        self._secret = secret
        self._outgoing = outgoing
        self._incoming = b"report" if outgoing == b"command" else b"command"
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(incoming)
        self._sent = 0
        self._received: dict[bytes, int] = {}  # peer -> last seq

    def _mac(self, peer: bytes, direction: bytes, seq: bytes, payload: bytes) -> bytes:
        return hmac.new(self._secret, b"|".join((peer, direction, seq)) + payload, hashlib.sha256).digest()

    def seal(self, peer: bytes, msg: object) -> list[bytes]:
        """`peer`: the rank identity the message is from (a report) or for (a command)."""
        self._sent += 1
        seq = struct.pack("<Q", self._sent)
        payload = self._encoder.encode(msg)
        return [seq, payload, self._mac(peer, self._outgoing, seq, payload)]

    def open(self, peer: bytes, frames: list[bytes]):
        if len(frames) != 3 or len(frames[0]) != 8:
            raise ChannelError(f"malformed message from {peer!r}")
        seq, payload, mac = frames
        if not hmac.compare_digest(self._mac(peer, self._incoming, seq, payload), mac):
            raise ChannelError(f"message from {peer!r} fails its MAC")
        (n,) = struct.unpack("<Q", seq)
        if n != self._received.get(peer, 0) + 1:
            raise ChannelError(f"message {n} from {peer!r} out of order (last {self._received.get(peer, 0)})")
        self._received[peer] = n
        try:
            return self._decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ChannelError(f"undecodable message from {peer!r}: {exc}") from None


def identity(rank: int) -> bytes:
    return f"rank-{rank}".encode()


class RootEnd:
    """Rank 0's end: one command for every rank, reports from any."""

    def __init__(self, secret: bytes) -> None:
        self._codecs: dict[bytes, _Codec] = {}  # per rank: its own command counter
        self._secret = secret
        self._reports = _Codec(secret, Report, b"command")
        self._sock = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
        self._sock.bind(f"tcp://{HOST}:0")
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def send(self, ranks: list[int], command: Command) -> None:
        for rank in ranks:
            peer = identity(rank)
            codec = self._codecs.setdefault(peer, _Codec(self._secret, Report, b"command"))
            try:
                self._sock.send_multipart([peer, *codec.seal(peer, command)])
            except zmq.ZMQError as exc:
                raise ChannelError(f"rank {rank} does not take commands: {exc}") from None

    def receive(self, timeout_s: float = 0.0) -> list[Report]:
        """Every report waiting (after at most `timeout_s` for the first)."""
        out = []
        timeout = int(timeout_s * 1000)
        while self._sock.poll(timeout):
            frames = self._sock.recv_multipart()
            out.append(self._reports.open(frames[0], frames[1:]))
            timeout = 0
        return out

    def close(self) -> None:
        self._sock.close(linger=0)


class RankEnd:
    """The end of rank `rank` (>= 1): commands in, reports out."""

    def __init__(self, secret: bytes, endpoint: str, rank: int) -> None:
        self._codec = _Codec(secret, Command, b"report")
        self._identity = identity(rank)
        self._sock = zmq.Context.instance().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.IDENTITY, identity(rank))
        self._sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
        self._sock.connect(endpoint)

    def report(self, report: Report) -> None:
        try:
            self._sock.send_multipart(self._codec.seal(self._identity, report))
        except zmq.ZMQError as exc:
            raise ChannelError(f"rank 0 does not take reports: {exc}") from None

    def receive(self, timeout_s: float) -> Command | None:
        if not self._sock.poll(int(timeout_s * 1000)):
            return None
        return self._codec.open(self._identity, self._sock.recv_multipart())

    def close(self) -> None:
        self._sock.close(linger=0)
