"""Prefix matching policies: what an admitted request can reuse, and what `commit` puts in the tree.
`PrefixReuse` (enable_block_reuse) matches full blocks by chained hash, then partially reuses one;
`NoReuse` is its null object. Both only plan or link: the facade checks capacity and executes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvcache.block import Block, Level
from kvcache.block_manager import BlockManager
from kvcache.hashing import ROOT_HASH, chain_hashes


@dataclass
class RequestState:
    """What the manager keeps of one live request."""

    request_id: str
    salt_digest: bytes  # hashing namespace of this request (manager salt + request salt)
    priority: int  # retention priority given to the blocks it uses
    blocks: list[list[Block | None]]  # per window group, in token order; None where released
    hashes: list[bytes] = field(default_factory=list)  # chained hashes of its full blocks so far
    committed: list[int] = field(default_factory=list)  # per group: leading blocks commit has handled
    commit_stopped: list[bool] = field(default_factory=list)  # per group: chain broken, commit no more
    released_upto: list[int] = field(default_factory=list)  # per group: blocks before it are released


@dataclass
class GroupPlan:
    chain: list[Block]  # reused full blocks in token order (a primary prefix, then secondary, then disk)
    partial: Block | None  # source block of the partially reused block (copied, or taken over)
    new_blocks: int  # blocks to allocate (a partial-copy destination included)

    def primary_needed(self, take_over: bool) -> int:
        """Primary slots this plan consumes: new blocks plus onboarded secondary and disk blocks."""
        onboards = sum(b.level is not Level.PRIMARY for b in self.chain)
        if take_over and self.partial is not None and self.partial.level is Level.SECONDARY:
            onboards += 1
        return self.new_blocks + onboards

    def disk_blocks(self) -> list[Block]:
        return [b for b in self.chain if b.level is Level.DISK]

    def keep(self) -> list[Block]:
        """Primary blocks that must survive the admission (their ancestors are implied)."""
        primary_chain = [b for b in self.chain if b.level is Level.PRIMARY]
        keep = primary_chain[-1:]  # the chain's primary blocks are a prefix: the last implies the rest
        if self.partial is not None and self.partial.level is Level.PRIMARY:
            keep.append(self.partial)
        return keep


@dataclass
class AdmitPlan:
    hit_tokens: int
    groups: list[GroupPlan]


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


class NoReuse:
    """enable_block_reuse=False: nothing is matched, nothing enters the reuse tree."""

    take_over = False

    def plan(self, req: RequestState, bms: Sequence[BlockManager], token_ids: Sequence[int],
             cap: int, total_blocks: int, partial_only_if_complete: bool = False) -> AdmitPlan:
        return AdmitPlan(0, [GroupPlan([], None, total_blocks) for _ in bms])

    def commit(self, req: RequestState, bms: Sequence[BlockManager], token_ids: Sequence[int],
               num_computed: int) -> None:
        return None


class PrefixReuse:
    def __init__(self, tokens_per_block: int, *, partial: bool, copy: bool, onboard: bool) -> None:
        self.tpb = tokens_per_block
        self.partial = partial
        self.take_over = partial and not copy
        self.max_level = Level.DISK if onboard else Level.PRIMARY  # deepest level a full block matches at
        # a partly matching block is reused from the primary or the host pool, never read from disk
        self.max_partial_level = min(self.max_level, Level.SECONDARY)

    def plan(self, req: RequestState, bms: Sequence[BlockManager], token_ids: Sequence[int],
             cap: int, total_blocks: int, partial_only_if_complete: bool = False) -> AdmitPlan:
        """Longest reusable prefix, the minimum over groups (`partial_only_if_complete`: see `admit`)."""
        tpb = self.tpb
        req.hashes = chain_hashes(token_ids, tpb, req.salt_digest, 0, ROOT_HASH, len(token_ids) // tpb)
        full = [bm.tree.match(req.hashes, self.max_level) for bm in bms]
        n = min(min(len(f) for f in full), cap // tpb)
        sources: list[Block | None] = [None] * len(bms)
        k = 0
        if self.partial and n * tpb < cap:
            tokens = tuple(token_ids[n * tpb:min(cap, (n + 1) * tpb)])
            found = [self._partial_source(bm, f[n - 1] if n else None, tokens, req.salt_digest)
                     for bm, f in zip(bms, full, strict=True)]
            if all(found):
                k = min(kg for _, kg in found)
                sources = [b for b, _ in found]
            if partial_only_if_complete and n * tpb + k < cap:
                k, sources = 0, [None] * len(bms)
        new = total_blocks - n - (1 if k and self.take_over else 0)
        groups = [GroupPlan(f[:n], src, new) for f, src in zip(full, sources, strict=True)]
        return AdmitPlan(n * tpb + k, groups)

    def _partial_source(self, bm: BlockManager, parent: Block | None, tokens: tuple[int, ...],
                        salt_dig: bytes) -> tuple[Block, int] | None:
        """The tree block under `parent` sharing the longest token prefix (>= 1) with `tokens`."""
        best: tuple[int, bool, Block] | None = None
        for c in bm.tree.partial_candidates(parent, tokens[0], salt_dig):
            if c.level > self.max_partial_level:
                continue
            if self.take_over and (c.in_use or c.children):
                continue
            key = (_common_prefix(c.tokens, tokens), c.level is Level.PRIMARY)
            if best is None or key > best[:2]:
                best = (*key, c)
        return None if best is None else (best[2], best[0])

    def commit(self, req: RequestState, bms: Sequence[BlockManager], token_ids: Sequence[int],
               num_computed: int) -> None:
        """Put the request's full, computed blocks into each group's tree (see KVCacheManager.commit)."""
        tpb = self.tpb
        n_full = min(num_computed, len(token_ids)) // tpb
        if n_full > len(req.hashes):
            parent = req.hashes[-1] if req.hashes else ROOT_HASH
            req.hashes += chain_hashes(token_ids, tpb, req.salt_digest, len(req.hashes), parent, n_full)
        for g, bm in enumerate(bms):
            if not req.commit_stopped[g]:
                self._commit_group(req, g, bm, token_ids, min(n_full, len(req.blocks[g])))

    def _commit_group(self, req: RequestState, g: int, bm: BlockManager, token_ids: Sequence[int],
                      n_full: int) -> None:
        blocks, tpb = req.blocks[g], self.tpb
        for i in range(req.committed[g], n_full):
            b, h = blocks[i], req.hashes[i]
            parent = blocks[i - 1] if i else None
            if b is None or (i and (parent is None or parent.hash != req.hashes[i - 1])):
                req.commit_stopped[g] = True  # released, or the chain above it left the tree
                return
            if b.hash is None:
                if h in bm.tree.by_hash:  # an equal block is cached: keep this one private
                    req.commit_stopped[g] = True
                    return
                bm.insert(b, h, parent, tuple(token_ids[i * tpb:(i + 1) * tpb]), req.salt_digest)
            req.committed[g] = i + 1
