"""The router's index of one server's reuse cache: which block hashes it holds, per window and tier.

`reset` from a snapshot, then `apply` every later event. Like the server's own prefix match
(kvcache/matching.py), a block counts only if every window group holds it and all blocks before it."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from kvcache import Level
from kvcache.events import MOVED, STORED

LEVELS = {level.name.lower(): level for level in Level}  # "primary", "secondary"


class KvIndex:
    """Hash -> tier per window group of one server (a tier is a `kvcache.Level` value)."""

    def __init__(self) -> None:
        self.windows: dict[int, dict[bytes, int]] = {}
        self.counts: Counter[tuple[int, int]] = Counter()  # (window, tier) -> blocks
        self.salt = ""  # the server's hashing namespace (model fingerprint, and its KV format if FP8)
        self.tokens_per_block = 0
        self.kv_dtype = ""  # the element type of the server's KV blocks ("" from a server that does not say)

    def reset(self, snapshot: dict) -> None:
        """Replace the content with a snapshot's (`windows`: {window: {level: [hex hashes]}}); raises
        ValueError, KeyError or TypeError if it is malformed (the index is then unchanged)."""
        windows: dict[int, dict[bytes, int]] = {}
        for window, levels in snapshot["windows"].items():
            blocks: dict[bytes, int] = {}
            for name, hashes in levels.items():
                level = int(LEVELS[name])
                blocks.update((bytes.fromhex(h), level) for h in hashes)
            windows[int(window)] = blocks
        tokens_per_block = int(snapshot["tokens_per_block"])
        salt, kv_dtype = snapshot["salt"], snapshot.get("kv_dtype", "")
        for key, value in (("salt", salt), ("kv_dtype", kv_dtype)):
            if not isinstance(value, str):
                raise TypeError(f"{key} must be a string, got {value!r}")
        self.windows, self.salt, self.tokens_per_block, self.kv_dtype = windows, salt, tokens_per_block, kv_dtype
        self.counts = Counter((window, level) for window, blocks in windows.items() for level in blocks.values())

    def clear(self) -> None:
        self.windows, self.counts = {}, Counter()

    def apply(self, window: int, kind: int, block_hash: bytes, level: int) -> None:
        blocks = self.windows.setdefault(window, {})
        old = blocks.pop(block_hash, None)
        if old is not None:
            self.counts[window, old] -= 1
        if kind in (STORED, MOVED):
            blocks[block_hash] = level
            self.counts[window, level] += 1

    def match(self, hashes: Sequence[bytes]) -> list[int]:
        """The tier of each leading block of `hashes` that every window group holds (a secondary
        copy in any group makes the block secondary: it must be onboarded first)."""
        groups = list(self.windows.values())
        if not groups:
            return []
        tiers: list[int] = []
        for block_hash in hashes:
            levels = [blocks.get(block_hash) for blocks in groups]
            if None in levels:
                break
            tiers.append(max(levels))
        return tiers
