"""Context side of the KV link: `KVSender` (engine thread: leases) and its socket thread
(`link.SenderLink`: ROUTER, handshakes; `serve.PullServer`: the pulls), which trade `lease` items."""

from transceiver.sender.kv_sender import KVSender

__all__ = ["KVSender"]
