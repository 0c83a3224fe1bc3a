"""Shared helpers of the kvcache tests (imported by the other test_kvcache_* files), and tests of the
helpers themselves. KV "computation" is simulated with a value per (token prefix, layer, K/V), so the
bytes of any block are a known function of the tokens before and in it."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from kv_factories import make_manager

from kvcache import KVCacheManager, Level, block_hashes

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
MOD = 131071  # values < 2**17, times 64, stay exact in float32


def token_values(tokens: Sequence[int]) -> list[int]:
    """v[t]: a value that depends on tokens[0..t] (a stand-in for the KV of position t)."""
    out, v = [], 0
    for tok in tokens:
        v = (v * 1000003 + tok + 1) % MOD
        out.append(v)
    return out


def _expected(values: Sequence[int], layers: int, like: torch.Tensor) -> torch.Tensor:
    """[layers, 2, n, heads, dim] with value v*64 + layer*2 + kv at token position i."""
    v = torch.tensor(values, dtype=torch.float64).view(1, 1, -1, 1, 1) * 64
    lk = (torch.arange(layers).view(-1, 1, 1, 1, 1) * 2 + torch.arange(2).view(1, -1, 1, 1, 1))
    out = (v + lk).expand(layers, 2, len(values), like.shape[-2], like.shape[-1])
    return out.to(dtype=like.dtype, device=like.device)


def _sync(m: KVCacheManager) -> None:
    if m.layout.device.type == "cuda":
        torch.cuda.synchronize()


def write_kv(m: KVCacheManager, request_id: str, tokens: Sequence[int], start: int, end: int) -> None:
    """Simulate the model computing positions [start, end) of `tokens` into the request's slots."""
    values = token_values(tokens[:end])
    tpb = m.tokens_per_block
    for w in m.window_sizes:
        pool = m.pool(w)
        slots = m.slot_table(request_id, w)
        for pos in range(start, end):
            slot = slots[pos // tpb]
            if slot >= 0:
                pool[slot, :, :, pos % tpb] = _expected([values[pos]], pool.shape[1], pool)[:, :, 0]


def assert_request_kv(m: KVCacheManager, request_id: str, tokens: Sequence[int], end: int) -> None:
    """The request's slots hold the right KV for positions [0, end) (skipping released blocks)."""
    _sync(m)
    values = token_values(tokens[:end])
    tpb = m.tokens_per_block
    for w in m.window_sizes:
        pool = m.pool(w)
        for i, slot in enumerate(m.slot_table(request_id, w)):
            n = min(tpb, end - i * tpb)
            if slot < 0 or n <= 0:
                continue
            want = _expected(values[i * tpb:i * tpb + n], pool.shape[1], pool)
            got = pool[slot, :, :, :n]
            assert torch.equal(got, want), f"request {request_id} window {w} block {i} slot {slot}"


class PrefixBook:
    """Remembers the token prefix behind every block hash, to check any cached block's bytes."""

    def __init__(self, tpb: int, salt: str = "") -> None:
        self.tpb, self.salt = tpb, salt
        self.prefix_of: dict[bytes, tuple[int, ...]] = {}

    def add(self, tokens: Sequence[int], salt: str | None = None) -> None:
        for i, h in enumerate(block_hashes(tokens, self.tpb, self.salt if salt is None else salt)):
            self.prefix_of[h] = tuple(tokens[:(i + 1) * self.tpb])

    def assert_cached_blocks(self, m: KVCacheManager) -> int:
        """Every block in every reuse tree holds the bytes of its prefix; returns how many were checked."""
        _sync(m)
        checked = 0
        for w in m.window_sizes:
            for h, (level, slot) in tree_locations(m, w).items():
                prefix = self.prefix_of[h]
                got = pool_block(m, w, level, slot, h)
                want = _expected(token_values(prefix)[-self.tpb:], got.shape[0], got)
                assert torch.equal(got, want), f"window {w} cached block at {level.name}:{slot}"
                checked += 1
        return checked


def pool_block(m: KVCacheManager, window: int, level: Level, slot: int, block_hash: bytes) -> torch.Tensor:
    """A cached block's bytes as [layers, 2, tpb, heads, dim]: a pool's slot, or for the disk level
    what the disk store reads back for it (its queued write, or its file, checked)."""
    primary = m.pool(window)
    if level is not Level.DISK:
        return m.pool(window, level)[slot]
    payload = m._disk.store.read_many([(window, slot, block_hash)])[0]
    assert isinstance(payload, memoryview), f"window {window} disk slot {slot}: {payload}"
    return torch.frombuffer(payload, dtype=primary.dtype).view(primary.shape[1:]).to(primary.device)


def tree_locations(m: KVCacheManager, window: int) -> dict[bytes, tuple[Level, int]]:
    """hash -> (level, slot) of every block in the group's reuse tree (reads the block manager)."""
    bm = m._by_window[window].bm
    return {h: (b.level, b.slot) for h, b in bm.tree.by_hash.items()}


@pytest.mark.parametrize("device", DEVICES)
def test_assert_request_kv_detects_one_wrong_element(device):
    m = make_manager(device)
    tokens = list(range(10))
    m.admit("r", tokens)
    write_kv(m, "r", tokens, 0, 10)
    assert_request_kv(m, "r", tokens, 10)
    m.pool(64)[m.slot_table("r", 64)[2], 0, 1, 1, 0, 3] += 1  # layer 0, V, position 9, head 0, dim 3
    with pytest.raises(AssertionError, match="block 2"):
        assert_request_kv(m, "r", tokens, 10)


def test_token_values_depend_on_the_whole_prefix():
    assert token_values([1, 2, 3])[:2] == token_values([1, 2, 4])[:2]
    assert token_values([1, 2, 3])[2] != token_values([1, 2, 4])[2]
    assert token_values([0, 2, 3])[2] != token_values([1, 2, 3])[2]


def refs(m: KVCacheManager, window: int = 64) -> dict[int, tuple[int, int]]:
    """block id -> (ref, pins) of every in-use block of the group (reads the block manager)."""
    return {b.id: (b.ref, b.pins) for b in m._by_window[window].bm.blocks if b.in_use}


def free_ids(m: KVCacheManager, window: int = 64, level: Level = Level.PRIMARY) -> list[int]:
    """Free block ids of a level in allocation order (reads the block manager)."""
    return [b.id for b in m._by_window[window].bm.free[level]]


def locate(m: KVCacheManager, block_ids: Sequence[int], window: int = 64) -> list[tuple[str, int]]:
    """(level name, slot) of each block, through the public translation call."""
    slots = m.get_memory_pool_block_indices(block_ids, window, require_primary=False)
    bm = m._by_window[window].bm
    return [(bm.blocks[i].level.name.lower()[0], s) for i, s in zip(block_ids, slots, strict=True)]


def run_prefill(m: KVCacheManager, request_id: str, tokens: Sequence[int], book: PrefixBook | None = None,
                **admit_kw) -> int:
    """What the engine does for a prefill: admit, compute every uncached position, commit."""
    hit = m.admit(request_id, tokens, **admit_kw)
    write_kv(m, request_id, tokens, hit, len(tokens))
    m.commit(request_id, tokens, len(tokens))
    if book is not None:
        book.add(tokens, admit_kw.get("salt"))
    return hit
