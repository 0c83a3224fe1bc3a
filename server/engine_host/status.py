"""What the HTTP side asks of a loaded engine besides its requests: transceiver liveness, KV
handshakes, the advertised KV sender, idleness (drain), and handshake probes.

The engine loop (server/engine_host/loop.py, on either host) calls them on its own thread, to put
them in the state it sends, and runs the probes it is asked for.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from server.types import LinkState

log = logging.getLogger(__name__)


def transceiver(core: Any) -> tuple[Any, Any]:
    """(KVSender or None, KVReceiver or None) of a loaded engine core (None: not loaded)."""
    role = getattr(core, "connector", None)
    return getattr(role, "sender", None), getattr(role, "receiver", None)


def links_of(core: Any) -> LinkState:
    sender, receiver = transceiver(core)
    dead = tuple(link.link_name for link in (sender, receiver) if link is not None and not link.link_alive)
    return LinkState(dead=dead, peers=receiver.peer_status() if receiver is not None else None,
                     sender=(sender.endpoint, sender.epoch) if sender is not None else None,
                     sender_endpoints=tuple(getattr(sender, "endpoints", ())))


def idle_of(core: Any) -> bool:
    """No request queued or running, no KV lease or pull (True before the core is loaded)."""
    if core is None:
        return True
    sender, receiver = transceiver(core)
    return not core.scheduler.has_work() and (sender is None or sender.num_leases == 0) \
        and (receiver is None or receiver.num_pulls == 0)


def probe(core: Any, endpoints: Iterable[str]) -> None:
    """Generation side: shake hands with every KV sender in `endpoints` (the layouts must agree)."""
    receiver = transceiver(core)[1]
    if receiver is None or not receiver.link_alive:
        return
    for endpoint in endpoints:
        try:
            receiver.probe(endpoint)
        except RuntimeError as exc:  # the socket thread stopped or is swamped: /health says so
            log.warning("could not probe %s: %s", endpoint, exc)
