"""Forking a request's KV: a child request that starts out holding its parent's blocks.

The child gets, in every window group, the parent's blocks for its first `num_tokens` tokens: each
full block is shared (one more reference, no copy) and the partly filled last block, if any, is
copied into a fresh block of the child's (its later tokens differ from the parent's). Entries the
parent released (out of a sliding window) stay released in the child. The child inherits the
parent's hashing state, so either of them may commit the shared blocks. Bookkeeping only: the copy
is recorded in the block manager and run by the pools when the facade's call returns.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvcache.admission import check_capacity
from kvcache.errors import KVCacheError
from kvcache.group import WindowGroup
from kvcache.matching import RequestState


def fork_request(parent: RequestState, child_id: str, groups: Sequence[WindowGroup], num_tokens: int,
                 tokens_per_block: int) -> RequestState:
    """The child's state, its blocks acquired and its partial block copied. Every check (the
    parent's blocks, the capacity of each group) runs before any change: OutOfBlocksError or
    KVCacheError leaves everything as it was."""
    n_full, rest = divmod(num_tokens, tokens_per_block)
    n_blocks = n_full + (1 if rest else 0)
    what = f"fork of request {parent.request_id!r} into {child_id!r}"
    for i, g in enumerate(groups):
        blocks = parent.blocks[i]
        if not 0 <= num_tokens <= len(blocks) * tokens_per_block:
            raise KVCacheError(f"{what}: num_tokens={num_tokens} outside [0, {len(blocks) * tokens_per_block}] "
                               f"(the capacity of its blocks)")
        if rest and blocks[n_full] is None:
            raise KVCacheError(f"{what}: its block {n_full} (window {g.window}), which holds token "
                               f"{num_tokens - 1}, was released")
    check_capacity(what, [(g.bm, g.window, 1 if rest else 0, []) for g in groups])
    child = RequestState(
        child_id, parent.salt_digest, parent.priority, [[] for _ in groups],
        hashes=parent.hashes[:n_full],
        committed=[min(c, n_full) for c in parent.committed],
        # the parent's commit stopped at a block the child shares: the child's stops there too
        commit_stopped=[stopped and c < n_full for stopped, c in zip(parent.commit_stopped, parent.committed,
                                                                     strict=True)],
        released_upto=[min(r, n_blocks) for r in parent.released_upto],
    )
    for i, g in enumerate(groups):
        shared = parent.blocks[i][:n_full]
        for b in shared:
            if b is not None:
                g.bm.acquire(b, parent.priority)
        child.blocks[i] = list(shared)
        if rest:
            own = g.bm.allocate(parent.priority)
            g.bm.copy(parent.blocks[i][n_full], own)
            child.blocks[i].append(own)
    return child
