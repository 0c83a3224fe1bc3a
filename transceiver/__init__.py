"""ZeroMQ KV transfer between a context and a generation server, laid out by side and thread
(docs/structure.md). Kept light: `transceiver.config` and `transceiver.wire` import without torch.
"""
