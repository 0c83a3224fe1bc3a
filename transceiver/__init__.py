"""ZeroMQ KV transfer between a context server (`sender.KVSender`) and a generation server
(`receiver.KVReceiver`): typed msgpack messages with an HMAC per message (`messages`, `codec`),
one socket-owning thread per side (`link`), zero-copy chunk frames (`payload`).

Import the classes from their modules (`transceiver.sender`, ...): this package file stays light so
that `transceiver.config` can be imported without torch or the KV cache.
"""
