"""Index of one window group's reuse tree (the blocks' `parent`/`children` links): chained block hash
-> block (so a walk of hash lookups follows a path), and (parent hash, first token) -> blocks for
partial matches. Pure Python, no torch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from kvcache.block import Block, Level


class ReuseTree:
    def __init__(self) -> None:
        self.by_hash: dict[bytes, Block] = {}
        # (parent hash, or the salt digest for a root child; first token) -> blocks. Keying root
        # children by salt keeps namespaces apart (deeper hashes already chain the salt).
        self._by_first: dict[tuple[bytes, int], dict[int, Block]] = {}
        self._key_of: dict[int, tuple[bytes, int]] = {}

    def __len__(self) -> int:
        return len(self.by_hash)

    def match(self, hashes: Sequence[bytes], max_level: Level = Level.DISK) -> list[Block]:
        """Blocks of the longest cached prefix of `hashes` (stops at the first block beyond
        `max_level`: levels never go back up along a path)."""
        out: list[Block] = []
        get = self.by_hash.get
        for h in hashes:
            b = get(h)
            if b is None or b.level > max_level:
                break
            out.append(b)
        return out

    def add(self, block: Block, block_hash: bytes, parent: Block | None, tokens: tuple[int, ...],
            salt_digest: bytes) -> None:
        block.hash = block_hash
        block.parent = parent
        block.tokens = tokens
        self.by_hash[block_hash] = block
        key = (parent.hash if parent is not None else salt_digest, tokens[0])
        self._by_first.setdefault(key, {})[block.id] = block
        self._key_of[block.id] = key

    def root_salt(self, block: Block) -> bytes:
        """The salt digest that keys root child `block`'s namespace."""
        assert block.parent is None, block
        return self._key_of[block.id][0]

    def remove(self, block: Block) -> None:
        key = self._key_of.pop(block.id)
        siblings = self._by_first[key]
        del siblings[block.id]
        if not siblings:
            del self._by_first[key]
        del self.by_hash[block.hash]
        block.hash = None
        block.parent = None
        block.tokens = ()

    def partial_candidates(self, parent: Block | None, first_token: int,
                           salt_digest: bytes) -> Iterator[Block]:
        """Tree blocks under `parent` (None: namespace `salt_digest`'s root) starting with `first_token`."""
        key = (parent.hash if parent is not None else salt_digest, first_token)
        yield from self._by_first.get(key, {}).values()
