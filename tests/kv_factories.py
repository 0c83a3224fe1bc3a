"""KV cache managers for tests that need one without a model (the layout is given by hand), and a
real KV link on loopback between two managers.

Tests import it as `import kv_factories` or `from kv_factories import make_manager` (tests/ is on
sys.path, see hf_reference). Capacities are counted in blocks per window group, so a test's
numbers say how many blocks each level holds whatever the layout's bytes per token.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from kvcache import CacheLayout, KvCacheConfig, KVCacheManager, KVFormat
from kvcache.config import DiskTierConfig
from transceiver.config import TransceiverConfig
from transceiver.receiver import KVReceiver
from transceiver.sender import KVSender

LINK_TOKEN = "loopback-link-test-token-0123456789"


def make_manager(device: str, *, tpb: int = 4, primary_blocks: int = 4, host_blocks: int = 0,
                 windows: Sequence[int] = (64,), max_seq_len: int = 64, heads: int = 2, dim: int = 4,
                 dtype: torch.dtype = torch.float32, salt: str = "", disk_blocks: int = 0,
                 disk_dir: str | None = None, disk_key: bytes = b"", disk: dict | None = None,
                 **cfg) -> KVCacheManager:
    """A manager with `primary_blocks` primary, `host_blocks` secondary and `disk_blocks` disk blocks
    per window group (the disk tier in `disk_dir`, with the other DiskTierConfig keys of `disk`);
    one layer per entry of `windows` (several sizes: VSWA groups), the other KvCacheConfig fields
    in `cfg`. Close it when it has a disk tier (its writer threads)."""
    layout = CacheLayout(tuple(windows), KVFormat(dtype, heads, dim), device, max_seq_len)
    block_bytes = tpb * layout.bytes_per_token()
    tier = DiskTierConfig(**{"path": str(disk_dir), "max_bytes": disk_blocks * block_bytes, **(disk or {})}) \
        if disk_blocks else None
    config = KvCacheConfig(tokens_per_block=tpb, max_tokens=primary_blocks * tpb,
                           host_cache_size=host_blocks * block_bytes, disk=tier, **cfg)
    return KVCacheManager(config, layout, salt=salt, disk_key=disk_key)


def kv_link(ctx_kv: KVCacheManager, gen_kv: KVCacheManager,
            fingerprints: tuple[str, str] = ("fp", "fp")) -> tuple[KVSender, KVReceiver]:
    """A real KV sender on `ctx_kv` and a receiver on `gen_kv`, on loopback, sharing one auth token;
    `fingerprints`: the model fingerprint each side announces (context, generation). The caller
    closes both."""
    config = TransceiverConfig(auth_token=LINK_TOKEN)
    return KVSender(ctx_kv, config, fingerprints[0]), KVReceiver(gen_kv, config, fingerprints[1])


@contextlib.contextmanager
def loopback_link(ctx_kv: KVCacheManager, gen_kv: KVCacheManager) -> Iterator[tuple[KVSender, KVReceiver]]:
    """`kv_link`'s sender and receiver, both closed on leaving."""
    sender, receiver = kv_link(ctx_kv, gen_kv)
    try:
        yield sender, receiver
    finally:
        receiver.close()
        sender.close()
