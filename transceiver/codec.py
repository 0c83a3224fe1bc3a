"""Sealing and opening of KV-link messages: msgpack header + HMAC-SHA256 frame, replay/staleness guard.

A message that fails any check raises `Rejected(reason)`; the socket thread drops it and counts it.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import OrderedDict

import msgspec

from transceiver.messages import PROTOCOL_VERSION, Body, Envelope

MAX_SKEW_S = 60.0  # |now - ts| above this: stale
MAC_BYTES = 32
MAX_HEADER_BYTES = 64 * 1024  # a header is a few hundred bytes; anything larger is garbage


class Rejected(Exception):
    """A message that must be dropped; `reason` is a short label for the rejected counter."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class ReplayGuard:
    """Remembers recent msg_ids (bounded memory); ids older than the staleness window are forgotten,
    since such a message would be rejected as stale anyway."""

    def __init__(self, window_s: float = 2 * MAX_SKEW_S, capacity: int = 200_000) -> None:
        self._seen: OrderedDict[int, float] = OrderedDict()  # msg_id -> arrival time, oldest first
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


class Codec:
    """Seals outgoing bodies and opens incoming frames for one endpoint of the link.

    Owned by one socket thread (the replay guard is not thread-safe)."""

    def __init__(self, token: bytes, epoch: str) -> None:
        if not token:
            raise ValueError("the KV link needs a non-empty auth token")
        self._token = token
        self.epoch = epoch
        self._encoder = msgspec.msgpack.Encoder()
        self._env_decoder = msgspec.msgpack.Decoder(Envelope)
        self._body_decoder = msgspec.msgpack.Decoder(Body)
        self._replay = ReplayGuard()

    def mac(self, header: bytes) -> bytes:
        return hmac.new(self._token, header, hashlib.sha256).digest()

    def seal(self, body: Body) -> list[bytes]:
        """[header, mac] for `body`, stamped with a fresh msg_id and the current time."""
        env = Envelope(
            version=PROTOCOL_VERSION,
            sender_epoch=self.epoch,
            msg_id=secrets.randbits(64),
            ts=time.time(),
            body=msgspec.Raw(self._encoder.encode(body)),
        )
        header = self._encoder.encode(env)
        return [header, self.mac(header)]

    def open(self, header: bytes, mac: bytes) -> tuple[str, Body]:
        """(sender_epoch, body) of an authentic, fresh, first-seen message of our version."""
        if len(header) > MAX_HEADER_BYTES or len(mac) != MAC_BYTES:
            raise Rejected("malformed")
        if not hmac.compare_digest(self.mac(header), mac):
            raise Rejected("bad_mac")
        try:
            env = self._env_decoder.decode(header)
        except (msgspec.DecodeError, msgspec.ValidationError):
            raise Rejected("undecodable") from None
        if env.version != PROTOCOL_VERSION:
            raise Rejected("wrong_version")
        now = time.time()
        if not abs(now - env.ts) <= MAX_SKEW_S:  # also catches NaN
            raise Rejected("stale")
        try:
            body = self._body_decoder.decode(env.body)
        except (msgspec.DecodeError, msgspec.ValidationError):
            raise Rejected("undecodable") from None
        if not self._replay.check_and_add(env.msg_id, now):
            raise Rejected("replayed")
        return env.sender_epoch, body
