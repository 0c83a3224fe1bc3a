"""transceiver/signed.py, the one sealing of every channel: a message verifies only on its own
channel, direction and peer; the ordered option refuses every replay, gap or reordering per peer;
typed bodies of another message type and other versions are refused."""

from __future__ import annotations

import msgspec
import pytest

from transceiver.signed import Rejected, SignedCodec

SECRET = b"k" * 32


class Ping(msgspec.Struct, tag=True, frozen=True):
    n: int


class Pong(msgspec.Struct, tag=True, frozen=True):
    n: int


def _ends(purpose: str = "test", secret: bytes = SECRET, **options) -> tuple[SignedCodec, SignedCodec]:
    """(the end that sends "up", the one that sends "down")"""
    return (SignedCodec(secret, purpose, "up", "down", Pong, **options),
            SignedCodec(secret, purpose, "down", "up", Ping, **options))


def _reason(codec: SignedCodec, frames: list[bytes], peer: bytes = b"") -> str:
    with pytest.raises(Rejected) as err:
        codec.open(*frames, peer=peer)
    return err.value.reason


def test_a_message_verifies_only_on_its_channel_direction_and_peer():
    client, server = _ends(epoch="e1")
    sealed = client.seal(Ping(1), peer=b"rank-1")
    assert server.open(*sealed, peer=b"rank-1") == ("e1", Ping(1))
    assert _reason(server, sealed, peer=b"rank-2") == "bad_mac"  # bound to its peer
    assert _reason(server, client.seal(Ping(2)), peer=b"rank-1") == "bad_mac"  # unbound: not for rank-1
    assert _reason(_ends("another purpose")[1], client.seal(Ping(3))) == "bad_mac"  # same secret, other channel
    assert _reason(_ends(secret=b"x" * 32)[1], client.seal(Ping(4))) == "bad_mac"
    mirror = SignedCodec(SECRET, "test", "up", "up", Ping)  # opens with the key of its own direction
    assert mirror.open(*client.seal(Ping(5))) == ("e1", Ping(5))
    assert _reason(client, client.seal(Ping(6))) == "bad_mac"  # played back to its sender


def test_ordered_counts_each_peer_and_refuses_replays_gaps_and_reordering():
    client, server = _ends(ordered=True)
    a1, a2, a3 = (client.seal(Ping(i), peer=b"a") for i in (1, 2, 3))
    b1 = client.seal(Ping(10), peer=b"b")
    assert server.open(*a1, peer=b"a")[1] == Ping(1)
    assert server.open(*b1, peer=b"b")[1] == Ping(10)  # b's own count
    assert _reason(server, a1, peer=b"a") == "out_of_order"  # replayed
    assert _reason(server, a3, peer=b"a") == "out_of_order"  # a2 missing
    assert server.open(*a2, peer=b"a")[1] == Ping(2)
    assert server.open(*a3, peer=b"a")[1] == Ping(3)


def test_fresh_refuses_a_replay_and_a_plain_channel_does_not():
    client, server = _ends(fresh=True)
    sealed = client.seal(Ping(1))
    assert server.open(*sealed)[1] == Ping(1)
    assert _reason(server, sealed) == "replayed"
    plain_client, plain_server = _ends()
    sealed = plain_client.seal(Ping(1))
    assert plain_server.open(*sealed) == plain_server.open(*sealed) == ("", Ping(1))


def test_another_message_type_or_version_is_refused():
    client, server = _ends()
    liar = SignedCodec(SECRET, "test", "up", "down", Pong)
    assert _reason(server, liar.seal(Pong(1))) == "undecodable"  # not a message of its direction
    newer = SignedCodec(SECRET, "test", "up", "down", Pong, version=2)
    assert _reason(server, newer.seal(Ping(1))) == "wrong_version"
    with pytest.raises(ValueError, match="at least 16 bytes"):
        SignedCodec(b"short", "test", "up", "down", Ping)
