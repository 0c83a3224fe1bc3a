"""A tensor-parallel server's rank processes: rank 0 tells ranks 1..N-1, over one authenticated
channel and in its order, every operation to mirror (docs/structure.md)."""
