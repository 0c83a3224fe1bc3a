"""ZeroMQ KV transfer between a context server and a generation server, laid out by side and thread:

- `wire`: the typed msgpack messages, their HMAC sealing and opening, and the KV layout check;
- `link`: the one socket-owning thread (`SocketThread`) both sides run, fed through bounded queues;
- `sender/`: `KVSender` (engine thread: leases) and its socket thread (`link`, `serve`: the pulls);
- `receiver/`: `KVReceiver` (engine thread: checks and scatters chunks) and its socket thread (`link`);
- `payload` (chunking, checksums, staging), `ipc` (same-GPU CUDA IPC), `stats`, `config`.

This package file stays light so that `transceiver.config` and `transceiver.wire` import without
torch or the KV cache.
"""
