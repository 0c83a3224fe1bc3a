"""Chained block hashes over token ids (prefix identity of full blocks).

hash_i = blake2b-128(hash_{i-1} || salt_digest || int64-LE bytes of block i's tokens), hash_{-1} = 16
zero bytes, salt_digest = blake2b-128(salt as UTF-8): equal hashes mean equal (salt, token prefix).
The same on every machine (the router recomputes it for kv-cache-aware routing).
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from hashlib import blake2b
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvcache.kv_format import KVFormat

DIGEST_BYTES = 16
ROOT_HASH = bytes(DIGEST_BYTES)


def salt_digest(salt: str) -> bytes:
    return blake2b(salt.encode("utf-8"), digest_size=DIGEST_BYTES).digest()


def chain_hashes(token_ids: Sequence[int], tokens_per_block: int, salt_dig: bytes, start_block: int,
                 parent: bytes, end_block: int) -> list[bytes]:
    """Hashes of full blocks start_block..end_block-1, chained from `parent` (hash of start_block - 1)."""
    span = 8 * tokens_per_block
    tokens = array("q", token_ids[start_block * tokens_per_block:end_block * tokens_per_block])  # one C-level pass
    if sys.byteorder != "little":
        tokens.byteswap()
    data = memoryview(tokens).cast("B")
    out: list[bytes] = []
    for off in range(0, (end_block - start_block) * span, span):
        parent = blake2b(parent + salt_dig + data[off:off + span], digest_size=DIGEST_BYTES).digest()
        out.append(parent)
    return out


def request_salt(manager_salt: str, salt: str | None) -> str:
    """A request's hashing namespace: the manager's salt refined by its own (a tenant's `cache_salt`)."""
    return manager_salt if salt is None else f"{manager_salt}\x1f{salt}"


def kv_format_salt(salt: str, kv_format: KVFormat) -> str:
    """`salt` refined by `KVFormat.hash_namespace`, so blocks of two formats never match in any tier
    (the router reads the refined salt from the server's snapshot)."""
    namespace = kv_format.hash_namespace
    return salt if not namespace else f"{salt}\x1ekv={namespace}"


def block_hashes(token_ids: Sequence[int], tokens_per_block: int, salt: str = "") -> list[bytes]:
    """Chained hash of every FULL block of `token_ids` (a trailing partial block has none)."""
    if tokens_per_block <= 0:
        raise ValueError(f"tokens_per_block={tokens_per_block!r}: must be > 0")
    n = len(token_ids) // tokens_per_block
    return chain_hashes(token_ids, tokens_per_block, salt_digest(salt), 0, ROOT_HASH, n)
