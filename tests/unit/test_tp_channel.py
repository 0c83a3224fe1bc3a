"""The rank channel: msgspec commands and reports, HMAC'd, in order, between real zmq sockets."""

from __future__ import annotations

import pytest
import zmq

from server.models.runner import SeqChunk
from server.tp.channel import ChannelError, RankEnd, RootEnd, identity
from server.tp.messages import Command, Copies, Forward, Joined, PullDone, Stop

SECRET = b"s" * 32


def _pair(rank: int = 1) -> tuple[RootEnd, RankEnd]:
    root = RootEnd(SECRET)
    end = RankEnd(SECRET, root.endpoint, rank)
    end.report(Joined(rank))
    assert root.receive(5.0) == [Joined(rank)]
    return root, end


def test_commands_and_reports_round_trip_in_order() -> None:
    root, end = _pair()
    try:
        step = Forward([SeqChunk([5, 6], 3, {64: [0, 1, -1], 512: [2]}, True)])
        root.send([1], Command([Copies(64, [(0, 1, 1, 7)]), step]))
        root.send([1], Command([Stop()]))
        assert end.receive(5.0) == Command([Copies(64, [(0, 1, 1, 7)]), step])
        assert end.receive(5.0) == Command([Stop()])
        end.report(PullDone(1, "r", True, nbytes=10))
        assert root.receive(5.0) == [PullDone(1, "r", True, nbytes=10)]
        assert end.receive(0.01) is None
    finally:
        end.close()
        root.close()


def test_a_forged_or_replayed_message_is_refused() -> None:
    root, end = _pair()
    forger = zmq.Context.instance().socket(zmq.DEALER)
    forger.setsockopt(zmq.LINGER, 0)
    forger.setsockopt(zmq.IDENTITY, identity(2))
    forger.connect(root.endpoint)
    try:
        end.report(Joined(1))
        assert root.receive(5.0) == [Joined(1)]  # the genuine one first (else one receive may take both)
        sealed = end._codec.seal(Joined(1), identity(1))  # what rank 1 would send next (seq 3) ...
        forger.send_multipart(sealed)  # ... coming from rank 2: its MAC names rank 1
        with pytest.raises(ChannelError, match="bad_mac"):
            root.receive(5.0)
        end._sock.send_multipart([sealed[0], b"x" * 32])  # rank 1, a wrong MAC
        with pytest.raises(ChannelError, match="bad_mac"):
            root.receive(5.0)
        end._sock.send_multipart(end._codec.seal(Joined(1), identity(1)))  # seq 4 after 2: one went missing
        with pytest.raises(ChannelError, match="out_of_order"):
            root.receive(5.0)
    finally:
        forger.close()
        end.close()
        root.close()
