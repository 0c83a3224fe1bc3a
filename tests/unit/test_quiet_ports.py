"""server/deploy/ports.py quiet_ports: deployment ports come from below the kernel's ephemeral range (where the
servers' own KV sockets and client connections draw theirs), free, distinct and split by lane."""

import socket

from server.deploy.ports import ephemeral_start, is_free, quiet_ports


def test_ports_are_below_the_ephemeral_range_free_and_distinct():
    ports = quiet_ports(20)
    assert len(set(ports)) == 20
    assert all(1024 <= p < ephemeral_start() for p in ports)
    assert all(is_free(p) for p in ports)


def test_lanes_never_share_a_port():
    first = set(quiet_ports(50, lane=0, lanes=2))
    second = set(quiet_ports(50, lane=1, lanes=2))
    assert not first & second
    assert max(first) < min(second)


def test_a_bound_port_is_neither_free_nor_handed_out():
    with socket.socket() as held:
        held.bind(("127.0.0.1", quiet_ports(1)[0]))
        port = held.getsockname()[1]
        assert not is_free(port)
        assert port not in quiet_ports(30, avoid={port})


def test_a_port_bound_to_zero_comes_from_the_ephemeral_range():
    # the reason for the whole module: an OS-chosen port can land on what bind(0) probes found
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        assert s.getsockname()[1] >= ephemeral_start()
