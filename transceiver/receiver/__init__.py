"""Generation side of the KV link: `KVReceiver` (engine thread: pulls, checksums, scatter) and its
socket thread (`link.ReceiverLink`: one DEALER per context server, handshakes)."""

from transceiver.receiver.kv_receiver import KVReceiver, PullResult

__all__ = ["KVReceiver", "PullResult"]
