"""ZeroMQ KV transfer between a context server and a generation server, laid out by side and thread
(docs/structure.md): `sender/` and `receiver/`, each an engine-thread half and a socket thread
(`link.SocketThread`); `wire` (messages, layout check), `signed` (sealing), `payload`, `ipc`, `tp`.

This package file stays light so that `transceiver.config` and `transceiver.wire` import without
torch or the KV cache.
"""
