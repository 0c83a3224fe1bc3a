"""Signed messages: the one sealing of every pdserve ZeroMQ channel (KV link, KV events, engine link,
rank channel). Typed msgspec messages in msgpack; nothing is ever unpickled.

A message is `[header, mac]` (a channel may add uncovered frames around them); `header` is msgpack
of `Envelope`, `mac` HMAC-SHA256 over the peer (length byte, bytes; empty unless bound to one) and
the header, under a key per channel purpose and direction (`derive_key`), checked first, in
constant time. Options, checked after it in this order: `version` (`wrong_version`); `fresh`: `ts`
within MAX_SKEW_S (`stale`), `seq` a random id not seen in that window (`replayed`); `ordered`:
`seq` counts each peer's messages from 1 (`out_of_order`: the rank channel); `max_bytes`: a longer
header is `malformed` before any MAC. A failure raises `Rejected` (`reason`: a counter label).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import OrderedDict
from typing import Any

import msgspec

MAC_BYTES = 32
MIN_SECRET_BYTES = 16
MAX_SKEW_S = 60.0  # |now - ts| above this: stale


class Rejected(Exception):
    """A message that must be dropped; `reason` is a short label (malformed, bad_mac, undecodable,
    wrong_version, stale, replayed, out_of_order)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class Envelope(msgspec.Struct, array_like=True, frozen=True):
    version: int
    epoch: str  # the sender's ("" on channels without one)
    seq: int  # ordered: the count of messages to or from the peer; fresh: a random id; else 0
    ts: float
    body: msgspec.Raw  # msgpack of one message, decoded once the envelope passed its checks


def derive_key(secret: bytes, purpose: str, direction: str) -> bytes:
    """The HMAC key of one channel's messages in one direction."""
    return hmac.new(secret, f"pdserve signed channel|{purpose}|{direction}".encode(), hashlib.sha256).digest()


def mac(key: bytes, header: bytes, peer: bytes = b"") -> bytes:
    return hmac.new(key, bytes([len(peer)]) + peer + header, hashlib.sha256).digest()


class ReplayGuard:
    """Recent ids in bounded memory; older than the staleness window they would be stale anyway."""

    def __init__(self, window_s: float = 2 * MAX_SKEW_S, capacity: int = 200_000) -> None:
        self._seen: OrderedDict[int, float] = OrderedDict()  # id -> arrival time, oldest first
        self._window_s = window_s
        self._capacity = capacity

    def check_and_add(self, msg_id: int, now: float) -> bool:
        """False if msg_id was seen within the window (a replay)."""
        while self._seen:
            oldest_id, t = next(iter(self._seen.items()))
            if now - t <= self._window_s and len(self._seen) < self._capacity:
                break
            del self._seen[oldest_id]
        if msg_id in self._seen:
            return False
        self._seen[msg_id] = now
        return True

    def __len__(self) -> int:
        return len(self._seen)


class SignedCodec:
    """One end of a channel (one thread's): seals what it `sends`, opens what it `receives` (direction
    names) into `incoming` (a Struct type or a union)."""

    def __init__(self, secret: bytes, purpose: str, sends: str, receives: str, incoming: Any, *,
                 epoch: str = "", version: int = 1, fresh: bool = False, ordered: bool = False,
                 max_bytes: int | None = None) -> None:
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"the {purpose} channel needs a secret of at least {MIN_SECRET_BYTES} bytes")
        self.send_key = derive_key(secret, purpose, sends)
        self._open_key = derive_key(secret, purpose, receives)
        self.epoch, self.version = epoch, version
        self._fresh, self._ordered, self._max_bytes = fresh, ordered, max_bytes
        self._encoder = msgspec.msgpack.Encoder()
        self._envelopes = msgspec.msgpack.Decoder(Envelope)
        self._bodies = msgspec.msgpack.Decoder(incoming)
        self._replay = ReplayGuard()
        self._sent: dict[bytes, int] = {}  # ordered: peer -> last seq sent
        self._received: dict[bytes, int] = {}  # ordered: peer -> last seq opened

    def seal(self, body: msgspec.Struct, peer: bytes = b"") -> list[bytes]:
        """[header, mac] of `body`; `peer`: the peer it is for (or from, on a rank's own end)."""
        if self._ordered:
            seq = self._sent[peer] = self._sent.get(peer, 0) + 1
        else:
            seq = secrets.randbits(64) if self._fresh else 0
        header = self._encoder.encode(Envelope(self.version, self.epoch, seq, time.time(),
                                               msgspec.Raw(self._encoder.encode(body))))
        return [header, mac(self.send_key, header, peer)]

    def open(self, header: bytes, tag: bytes, peer: bytes = b"") -> tuple[str, Any]:
        """(the sender's epoch, the body) of a message that passes every check of the channel."""
        if (self._max_bytes is not None and len(header) > self._max_bytes) or len(tag) != MAC_BYTES:
            raise Rejected("malformed")
        if not hmac.compare_digest(mac(self._open_key, header, peer), tag):
            raise Rejected("bad_mac")
        env = self._decode(self._envelopes, header)
        if env.version != self.version:
            raise Rejected("wrong_version", f"{env.version}, not {self.version}")
        now = time.time()
        if self._fresh and not abs(now - env.ts) <= MAX_SKEW_S:  # also catches NaN
            raise Rejected("stale")
        if self._ordered and env.seq != self._received.get(peer, 0) + 1:
            raise Rejected("out_of_order", f"message {env.seq} after {self._received.get(peer, 0)}")
        body = self._decode(self._bodies, env.body)
        if self._fresh and not self._replay.check_and_add(env.seq, now):
            raise Rejected("replayed")
        if self._ordered:
            self._received[peer] = env.seq
        return env.epoch, body

    @staticmethod
    def _decode(decoder: msgspec.msgpack.Decoder, data: bytes) -> Any:
        try:
            return decoder.decode(data)
        except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
            raise Rejected("undecodable", str(exc)) from None
