"""The KV layout a server advertises in the handshake, read from its KV cache manager."""

from __future__ import annotations

from kvcache import KVCacheManager, Level
from transceiver.messages import Layout, WindowLayout


def layout_of(kv: KVCacheManager, fingerprint: str) -> Layout:
    """Per window group: layers, kv heads, head dim, dtype and slot bytes of the primary pool."""
    windows = []
    for window in sorted(kv.window_sizes):
        pool = kv.pool(window, Level.PRIMARY)  # [num_slots, layers, 2, tpb, kv_heads, head_dim]
        windows.append(WindowLayout(
            window=window, layers=list(kv.group_layers(window)), kv_heads=int(pool.shape[4]),
            head_dim=int(pool.shape[5]), dtype=str(pool.dtype).removeprefix("torch."),
            slot_bytes=kv.slot_bytes(window),
        ))
    return Layout(tokens_per_block=kv.tokens_per_block, windows=windows, fingerprint=fingerprint)
