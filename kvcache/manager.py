"""KVCacheManager: the facade the engine and the transceiver use (engine thread only, not thread-safe).

One BlockManager + GroupPools per window group (VSWA; a full attention layer's window is max_seq_len).
Live requests' blocks stay PRIMARY with stable slots; recorded copies run at the end of each public call.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from kvcache.admission import check_capacity, execute_plan, make_primary
from kvcache.block import Block, CopyOp, Level
from kvcache.config import DiskTierConfig, KvCacheConfig
from kvcache.disk_mirror import DiskMirror
from kvcache.disk_store import BlockMeta
from kvcache.disk_tier import DiskTier, NoDiskTier, PeerCheck, open_store
from kvcache.errors import KVCacheError
from kvcache.group import WindowGroup, level_sizes
from kvcache.hashing import kv_format_salt, request_salt, salt_digest
from kvcache.integrity import check_accounting, check_block_manager, check_request_refs
from kvcache.layout import CacheLayout
from kvcache.matching import AdmitPlan, NoReuse, PrefixReuse, RequestState
from kvcache.stats import KVCacheStats

T = TypeVar("T", bound=Callable)


def _flushes(method: T) -> T:
    """Run the copies the call recorded (in order, batched per pool) when it returns or raises."""

    @functools.wraps(method)
    def wrapper(self: KVCacheManager, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        finally:
            for g in self._groups:
                if g.bm.copies:
                    g.pools.execute(g.bm.copies)
                    for observer in self._copy_observers:
                        observer(g.window, list(g.bm.copies))
                    g.bm.copies.clear()
                self._disk.after_flush(g)

    return wrapper  # type: ignore[return-value]


class KVCacheManager:
    """Paged KV cache of one model. `salt` is the hashing namespace (model fingerprint), refined by a
    request's salt and by a non-default KV format (`kv_format_salt`; `self.salt` is the refined one,
    advertised in the KV events' snapshot). `disk_key` seals the disk files (from the deployment
    token). Block ids are per window group; -1 means released. Call `close` at the end."""

    def __init__(self, config: KvCacheConfig, layout: CacheLayout, *, salt: str = "", disk_key: bytes = b"") -> None:
        self.config = config
        self.layout = layout
        self.salt = kv_format_salt(salt, layout.format)
        self.tokens_per_block = tpb = config.tokens_per_block
        self.window_sizes: tuple[int, ...] = tuple(sorted(set(layout.layer_windows)))
        sizes = level_sizes(config, layout)
        self._groups = [WindowGroup(config, layout, w, *sizes) for w in self.window_sizes]
        self._disk: DiskTier | NoDiskTier = NoDiskTier()
        if config.disk is not None:
            self._disk = DiskTier.open(config, layout, self.salt, disk_key, self._groups)
        self._by_window = {g.window: g for g in self._groups}
        self._layer_group = {layer: g for g in self._groups for layer in g.layers}
        self._policy: PrefixReuse | NoReuse = NoReuse()
        if config.enable_block_reuse:
            self._policy = PrefixReuse(tpb, partial=config.enable_partial_reuse,
                                       copy=config.copy_on_partial_reuse, onboard=config.onboard_blocks)
        self._requests: dict[str, RequestState] = {}
        self._query_tokens = self._hit_tokens = 0
        self._copy_observers: list[Callable[[int, list[CopyOp]], None]] = []

    # ---- layout
    def group_layers(self, window: int) -> tuple[int, ...]:
        return self._group(window).layers

    def layer_window(self, layer_idx: int) -> int:
        return self._layer(layer_idx).window

    def layer_cache(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer, each [num_primary_slots, tpb, kv_heads, head_dim] (views of the pool)."""
        if self.layout.format.latent:
            raise KVCacheError("a latent KV cache has no K and V planes (layer_latent)")
        g = self._layer(layer_idx)
        local = g.layers.index(layer_idx)
        return g.pools.primary[:, local, 0], g.pools.primary[:, local, 1]

    def layer_latent(self, layer_idx: int) -> torch.Tensor:
        """A latent cache's layer: [num_primary_slots, tpb, kv_lora_rank + qk_rope_head_dim] (a view)."""
        if not self.layout.format.latent:
            raise KVCacheError("a K/V heads cache has no latent plane (layer_cache)")
        g = self._layer(layer_idx)
        return g.pools.primary[:, g.layers.index(layer_idx), 0, :, 0]

    def pool(self, window: int, level: Level = Level.PRIMARY) -> torch.Tensor | None:
        """[num_slots, num_layers_in_group, planes, tpb, kv_heads, head_dim]; None if the level has no slots."""
        return self._group(window).pools.pool(level)

    def observe_copies(self, observer: Callable[[int, list[CopyOp]], None]) -> None:
        """`observer(window, ops)` sees every batch of copies after it ran (TP ranks replay them)."""
        self._copy_observers.append(observer)

    def apply_copies(self, window: int, ops: Sequence[CopyOp]) -> None:
        """Run another manager's copies (`observe_copies`) on these pools; bookkeeping untouched."""
        self._group(window).pools.execute(ops)

    def disk_block_meta(self, window: int, slot: int) -> BlockMeta | None:
        """What disk slot `slot`'s file says about its block now (None: free, or no disk tier)."""
        return self._disk.describe(self._group(window), slot)

    def share_disk_checks(self, peers: PeerCheck) -> None:
        """Disk file checks ask `peers` too; a block one of them could not read back is dropped."""
        self._disk.peers = peers

    def mirror_disk(self, disk: DiskTierConfig, key: bytes, num_disk: int) -> DiskMirror:
        """Files of these pools for another manager's `num_disk` disk slots under `disk.path`
        (kvcache/disk_mirror.py)."""
        if isinstance(self._disk, DiskTier):
            raise KVCacheError("a manager with a disk tier of its own cannot mirror another's")
        store, _ = open_store(disk, self.config, self.layout, self.salt, key, self._groups, num_disk)
        return DiskMirror(store, self._groups)

    def slot_bytes(self, window: int) -> int:
        return self._group(window).pools.slot_bytes

    def num_slots(self, window: int, level: Level = Level.PRIMARY) -> int:
        return self._group(window).bm.num_slots[level]

    def num_available_blocks(self, window: int | None = None) -> int:
        """Free plus evictable primary blocks (minimum over groups if no window): exactly what
        admit/extend check, so a request that fits never fails midway."""
        groups = self._groups if window is None else [self._group(window)]
        return min(g.bm.evictable_keeping([]) for g in groups)

    # ---- requests
    @_flushes
    def admit(self, request_id: str, token_ids: Sequence[int], *, num_tokens: int | None = None,
              max_cached_tokens: int | None = None, priority: int = 35, salt: str | None = None,
              partial_only_if_complete: bool = False) -> int:
        """Reuse the longest cached prefix (at most max_cached_tokens, default len(token_ids) - 1: the
        last token is computed for its logits), allocate blocks for `num_tokens`; return the tokens
        reused. `partial_only_if_complete`: a partly matching block only if the hit then reaches the
        cap (a caller fetching the rest by whole blocks would overwrite it). `salt`: a tenant's
        cache_salt; blocks keep their last user's `priority`. OutOfBlocksError before any change."""
        if request_id in self._requests:
            raise KVCacheError(f"request {request_id!r} is already admitted")
        n_tok = len(token_ids) if num_tokens is None else num_tokens
        self._check_length(request_id, n_tok, minimum=len(token_ids))
        if not 0 <= priority <= 100:
            raise ValueError(f"request {request_id!r}: priority={priority!r} must be in [0, 100]")
        if max_cached_tokens is not None and max_cached_tokens < 0:
            raise ValueError(f"request {request_id!r}: max_cached_tokens={max_cached_tokens} is negative")
        cap = len(token_ids) - 1 if max_cached_tokens is None else min(max_cached_tokens, len(token_ids))
        n = len(self._groups)
        req = RequestState(request_id, salt_digest(request_salt(self.salt, salt)), priority,
                           [[] for _ in range(n)], committed=[0] * n, commit_stopped=[False] * n,
                           released_upto=[0] * n)
        plan = self._plan(req, token_ids, max(cap, 0), -(-n_tok // self.tokens_per_block), partial_only_if_complete)
        for i, (g, gp) in enumerate(zip(self._groups, plan.groups, strict=True)):
            req.blocks[i] = execute_plan(g.bm, gp, priority, take_over=self._policy.take_over)
        self._requests[request_id] = req
        self._query_tokens += len(token_ids)
        self._hit_tokens += plan.hit_tokens
        return plan.hit_tokens

    def _plan(self, req: RequestState, token_ids: Sequence[int], cap: int, total_blocks: int,
              partial_only_if_complete: bool) -> AdmitPlan:
        """The checked plan (a disk block whose file fails its check is dropped, and it is planned again)."""
        bms = [g.bm for g in self._groups]
        plan = self._policy.plan(req, bms, token_ids, cap, total_blocks, partial_only_if_complete)
        self._check_plan_capacity(req.request_id, plan)
        disk = [(g, gp.disk_blocks()) for g, gp in zip(self._groups, plan.groups, strict=True)]
        if any(blocks for _, blocks in disk) and self._disk.check(disk):
            plan = self._policy.plan(req, bms, token_ids, cap, total_blocks, partial_only_if_complete)
            self._check_plan_capacity(req.request_id, plan)
        return plan

    def _check_plan_capacity(self, request_id: str, plan: AdmitPlan) -> None:
        take_over = self._policy.take_over
        check_capacity(f"request {request_id!r}", [(g.bm, g.window, gp.primary_needed(take_over), gp.keep())
                                                   for g, gp in zip(self._groups, plan.groups, strict=True)])

    @_flushes
    def extend(self, request_id: str, num_tokens: int) -> None:
        """Ensure capacity for `num_tokens` tokens in total (atomic OutOfBlocksError)."""
        req = self._request(request_id)
        self._check_length(request_id, num_tokens, minimum=0)
        total = -(-num_tokens // self.tokens_per_block)
        needs = [max(0, total - len(blocks)) for blocks in req.blocks]
        check_capacity(f"request {request_id!r}",
                       [(g.bm, g.window, need, []) for g, need in zip(self._groups, needs, strict=True)])
        for g, blocks, need in zip(self._groups, req.blocks, needs, strict=True):
            blocks += [g.bm.allocate(req.priority) for _ in range(need)]

    @_flushes
    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> None:
        """Admit `child_id` holding `parent_id`'s KV of its first `num_tokens` tokens (the n choices of
        one prompt): full blocks shared, a partly filled last one copied (its later tokens differ),
        released ones still released; either may commit the shared blocks. Checks come first."""
        if child_id in self._requests:
            raise KVCacheError(f"request {child_id!r} is already admitted")
        parent, tpb = self._request(parent_id), self.tokens_per_block
        n_full, rest = divmod(num_tokens, tpb)
        what = f"fork of request {parent_id!r} into {child_id!r}"
        for i, g in enumerate(self._groups):
            blocks = parent.blocks[i]
            if not 0 <= num_tokens <= len(blocks) * tpb:
                raise KVCacheError(f"{what}: num_tokens={num_tokens} outside [0, {len(blocks) * tpb}] "
                                   f"(the capacity of its blocks)")
            if rest and blocks[n_full] is None:
                raise KVCacheError(f"{what}: its block {n_full} (window {g.window}), which holds token "
                                   f"{num_tokens - 1}, was released")
        check_capacity(what, [(g.bm, g.window, 1 if rest else 0, []) for g in self._groups])
        child = RequestState(
            child_id, parent.salt_digest, parent.priority, [[] for _ in self._groups],
            hashes=parent.hashes[:n_full],
            committed=[min(c, n_full) for c in parent.committed],
            # the parent's commit stopped at a block the child shares: the child's stops there too
            commit_stopped=[stopped and c < n_full for stopped, c in zip(parent.commit_stopped, parent.committed,
                                                                         strict=True)],
            released_upto=[min(r, n_full + (1 if rest else 0)) for r in parent.released_upto],
        )
        for i, g in enumerate(self._groups):
            shared = parent.blocks[i][:n_full]
            for b in shared:
                if b is not None:
                    g.bm.acquire(b, parent.priority)
            child.blocks[i] = list(shared)
            if rest:
                own = g.bm.allocate(parent.priority)
                g.bm.copy(parent.blocks[i][n_full], own)
                child.blocks[i].append(own)
        self._requests[child_id] = child

    def commit(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Put every full, computed block into the reuse tree (call after each step). If an equal block
        is cached already, this one stays private and commit stops for that group: later blocks would
        hang under a block the request does not hold (the primary level must stay prefix-closed)."""
        req = self._request(request_id)
        capacity = len(req.blocks[0]) * self.tokens_per_block
        if not 0 <= num_computed_tokens <= min(capacity, len(token_ids)):
            raise KVCacheError(f"request {request_id!r}: num_computed_tokens={num_computed_tokens} is "
                               f"outside [0, min(capacity {capacity}, {len(token_ids)} tokens)]")
        self._policy.commit(req, [g.bm for g in self._groups], token_ids, num_computed_tokens)

    def release(self, request_id: str) -> None:
        """Drop the request's references; its full committed blocks stay cached for reuse."""
        req = self._requests.pop(request_id, None)
        if req is None:
            raise KVCacheError(f"release of unknown request {request_id!r} "
                               "(never admitted or already released)")
        for g, blocks in zip(self._groups, req.blocks, strict=True):
            for b in reversed(blocks):
                if b is not None:
                    g.bm.release(b)

    def release_out_of_window(self, request_id: str, num_computed_tokens: int) -> int:
        """Drop references to blocks wholly before the window of token num_computed_tokens (block_ids
        shows -1); returns how many. A tree block stays cached, reclaimable once nothing below it is
        in use (eviction takes leaves only: usually when the request ends)."""
        req = self._request(request_id)
        released = 0
        for i, g in enumerate(self._groups):
            blocks = req.blocks[i]
            end = min(len(blocks), max(0, num_computed_tokens - g.window + 1) // self.tokens_per_block)
            for j in range(req.released_upto[i], end):
                if blocks[j] is not None:
                    g.bm.release(blocks[j])
                    blocks[j] = None
                    released += 1
            req.released_upto[i] = max(end, req.released_upto[i])
        return released

    def block_ids(self, request_id: str, window: int | None = None) -> list[int]:
        """Logical block ids of the request in token order (-1 where released)."""
        return [-1 if b is None else b.id for b in self._blocks(request_id, window)]

    def slot_table(self, request_id: str, window: int) -> list[int]:
        """Primary slots of the request's blocks in token order (-1 where released)."""
        return [-1 if b is None else b.slot for b in self._blocks(request_id, window)]

    def _blocks(self, request_id: str, window: int | None) -> list[Block | None]:
        return self._request(request_id).blocks[self._groups.index(self._resolve(window))]

    @_flushes
    def pin_blocks(self, block_ids: Sequence[int], window: int) -> None:
        """Pin blocks (onboarding any that are not primary); a pinned block is never evicted."""
        g = self._resolve(window)
        for b in self._make_primary(g, block_ids):
            g.bm.pin(b)

    def unpin_blocks(self, block_ids: Sequence[int], window: int) -> None:
        g = self._resolve(window)
        blocks = [g.bm.get(i) for i in block_ids if i != -1]  # -1: a released (out-of-window) block
        for block_id, times in Counter(b.id for b in blocks).items():
            if g.bm.blocks[block_id].pins < times:
                raise KVCacheError(f"unpin of block {block_id} (window {g.window}), which is not pinned "
                                   f"(or pinned fewer times than listed)")
        for b in blocks:
            g.bm.unpin(b)

    # ---- translation
    def get_memory_pool_block_indices(self, block_ids: Sequence[int], window_size: int | None = None,
                                      require_primary: bool = True) -> list[int]:
        """Slots of block ids (-1 stays -1); require_primary=False: in whichever pool holds each."""
        g = self._resolve(window_size)
        out = []
        for i in block_ids:
            b = None if i == -1 else g.bm.get(i)
            if require_primary and b is not None and b.level is not Level.PRIMARY:
                raise KVCacheError(f"block {i} (window {g.window}) is not in the primary pool (secondary "
                                   f"slot {b.slot}); call ensure_primary or pin_blocks first")
            out.append(-1 if b is None else b.slot)
        return out

    @_flushes
    def ensure_primary(self, block_ids: Sequence[int], window_size: int | None = None) -> None:
        """Onboard (batched) every listed block not in the primary pool. Pin them to keep them there."""
        self._make_primary(self._resolve(window_size), block_ids)

    def _make_primary(self, g: WindowGroup, block_ids: Sequence[int]) -> list[Block]:
        """The listed blocks (-1 skipped), made primary; disk files checked first (`before_onboard`)."""
        blocks = [g.bm.get(i) for i in block_ids if i != -1]
        make_primary(g.bm, g.window, blocks, lambda onboard: self._disk.before_onboard(g, blocks, onboard))
        return blocks

    def cached_block_hashes(self, window: int | None = None) -> list[bytes]:
        """Hashes of the blocks in the group's reuse tree, any level (default: the largest window)."""
        g = self._groups[-1] if window is None else self._group(window)
        return list(g.bm.tree.by_hash)

    def cached_blocks(self) -> dict[int, dict[Level, list[bytes]]]:
        """Window -> level -> hashes of the reuse tree's blocks there (a KV events snapshot; O(blocks))."""
        out: dict[int, dict[Level, list[bytes]]] = {}
        for g in self._groups:
            out[g.window] = {level: [] for level in Level}
            for block_hash, b in g.bm.tree.by_hash.items():
                out[g.window][b.level].append(block_hash)
        return out

    # ---- KV events (kvcache/events.py)
    def enable_events(self) -> None:
        """From now on record every reuse-tree change; drain them with `drain_events` (else they pile up)."""
        for g in self._groups:
            if not isinstance(g.bm.events, list):
                g.bm.events = []

    def drain_events(self) -> list[tuple[int, int, bytes, int]]:
        """(window, kind, block hash, level) of every change since the last drain, in order per window."""
        out: list[tuple[int, int, bytes, int]] = []
        for g in self._groups:
            if isinstance(g.bm.events, list):
                out += [(g.window, kind, block_hash, int(level)) for kind, block_hash, level in g.bm.events]
                g.bm.events.clear()
        return out

    # ---- checks and counters
    def check_integrity(self) -> None:
        """Raise KVCacheError describing the first broken invariant (O(blocks); tests, debug)."""
        for i, g in enumerate(self._groups):
            check_block_manager(g.bm, f"window {g.window}")
            check_request_refs(g.bm, f"window {g.window}", [req.blocks[i] for req in self._requests.values()])

    def check_accounting(self) -> None:
        """The cheap subset of `check_integrity` (O(blocks of live requests)), for periodic health checks."""
        for i, g in enumerate(self._groups):
            check_accounting(g.bm, f"window {g.window}", [req.blocks[i] for req in self._requests.values()])

    def close(self) -> None:
        """Let the disk tier's queued writes land (bounded by disk.io_timeout_s) and stop its threads."""
        self._disk.close()

    def request_ids(self) -> list[str]:
        return list(self._requests)

    def num_pins(self, window: int) -> int:
        """Pins held on the group's blocks in total (a block pinned twice counts twice); O(1)."""
        return self._group(window).bm.num_pins

    def pinned_blocks(self, window: int) -> Counter[int]:
        """Block id -> pins, for every pinned block of the group (O(blocks): to describe a problem)."""
        return Counter({b.id: b.pins for b in self._group(window).bm.blocks if b.pins})

    def stats(self) -> KVCacheStats:
        s = KVCacheStats(prefix_query_tokens=self._query_tokens, prefix_hit_tokens=self._hit_tokens)
        for g in self._groups:
            g.add_stats(s)
        self._disk.add_stats(s)
        return s

    def _group(self, window: int) -> WindowGroup:
        g = self._by_window.get(window)
        if g is None:
            raise ValueError(f"unknown window size {window!r} (windows: {list(self.window_sizes)})")
        return g

    def _resolve(self, window: int | None) -> WindowGroup:
        if window is None:
            if len(self._groups) > 1:
                raise ValueError("window_size must be provided for VSWA "
                                 f"(windows: {list(self.window_sizes)})")
            return self._groups[0]
        return self._group(window)

    def _layer(self, layer_idx: int) -> WindowGroup:
        g = self._layer_group.get(layer_idx)
        if g is None:
            raise ValueError(f"unknown layer {layer_idx!r} (the model has {self.layout.num_layers} layers)")
        return g

    def _request(self, request_id: str) -> RequestState:
        req = self._requests.get(request_id)
        if req is None:
            raise KVCacheError(f"unknown request {request_id!r} (never admitted or already released)")
        return req

    def _check_length(self, request_id: str, num_tokens: int, minimum: int) -> None:
        if not minimum <= num_tokens <= self.layout.max_seq_len:
            raise ValueError(f"request {request_id!r}: num_tokens={num_tokens} outside "
                             f"[{minimum}, max_seq_len={self.layout.max_seq_len}]")
