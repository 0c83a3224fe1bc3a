"""A tensor-parallel server's rank processes (docs/structure.md, "Tensor parallel").

Rank 0 is the server process (HTTP, engine thread, shard 0). It spawns ranks 1..N-1 and tells them,
over one authenticated channel, every operation to mirror in its order (`messages.Op`): pool copies,
forwards, leases and pulls. `worker.py` is the other ranks' loop."""
