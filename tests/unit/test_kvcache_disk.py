"""Exact-state tests of the disk tier (kv_cache_config.disk): blocks move primary -> host -> disk ->
host -> primary with their ids; a file that fails its check is dropped, never served; the manifest
decides whether a restarted server finds its blocks again; the disk level evicts by priority, then
LRU. Real files in pytest's tmp_path, the real writer and reader threads.

tpb 4, one layer group (window 64); `locate` gives (level initial, slot) per block id."""

from __future__ import annotations

import logging
import shutil

import pytest
from kv_factories import make_manager
from test_kvcache_support import PrefixBook, assert_request_kv, locate, refs, run_prefill
from waiting import wait_until

from kvcache import KVCacheError, KVCacheManager, Level, block_hashes
from kvcache.block_manager import BlockManager
from kvcache.events import REMOVED

KEY = bytes(range(32))
A, B, C, D, E = ([t] * 4 for t in range(1, 6))


@pytest.fixture
def open_managers():
    """Managers made through `disk` are closed at the end of the test (their writer threads)."""
    made: list[KVCacheManager] = []
    yield made
    for m in made:
        m.close()


@pytest.fixture
def disk(tmp_path, open_managers):
    def make(*, key: bytes = KEY, salt: str = "fp", primary: int = 2, host: int = 2, blocks: int = 3,
             **disk_cfg) -> KVCacheManager:
        m = make_manager("cpu", primary_blocks=primary, host_blocks=host, disk_blocks=blocks,
                         disk_dir=str(tmp_path / "kv"), disk_key=key, salt=salt,
                         secondary_offload_min_priority=0, disk=disk_cfg or None)
        open_managers.append(m)
        return m
    return make


def written(m: KVCacheManager) -> None:
    """Wait until every queued write has landed in its file."""
    wait_until(lambda: m.stats().disk_queued_bytes == 0 and not m._disk.store._pending, 10,
               what="the disk tier's queued writes to land")


def push_a_to_disk(m: KVCacheManager, book: PrefixBook | None = None) -> None:
    """Five one-block prompts through a 2-block primary and a 2-block host pool: a's block goes
    primary -> host -> disk (block ids: 0 a, 1 b, 2 c, 3 d, 4 e; host blocks start as 2 and 3,
    disk blocks as 4, 5, 6)."""
    for rid, tokens in zip("abcde", (A, B, C, D, E), strict=True):
        run_prefill(m, rid, tokens, book)
        m.release(rid)
    written(m)


def test_blocks_go_down_to_disk_and_come_back_up_with_their_ids(disk, tmp_path):
    m = disk()
    book = PrefixBook(4, salt="fp")
    push_a_to_disk(m, book)
    # c's offload found the host full: its LRU block, a's 0, went down to disk block 4's slot 0
    assert locate(m, [0, 1, 2, 3, 4]) == [("d", 0), ("s", 1), ("s", 0), ("p", 1), ("p", 0)]
    assert (tmp_path / "kv" / "w64" / "0.kv").stat().st_size > m.slot_bytes(64)  # a header, then the KV
    s = m.stats()
    assert (s.offloads, s.disk_offloads, s.disk_onboards, s.disk_bytes_written) == (3, 1, 0, m.slot_bytes(64))
    assert s.blocks[64, "disk", "cached"] == 1 and s.blocks[64, "disk", "free"] == 2
    assert book.assert_cached_blocks(m) == 5  # the disk block read back from its file

    assert m.admit("a2", A + [9]) == 4
    # a's block 0 was promoted (host LRU b went down to d1; 0 took the host slot s1), then onboarded
    # (d, LRU in primary, went to the host; the host's c went down to d2); the new block 6 came
    # from e's eviction
    assert m.block_ids("a2") == [0, 6] and m.slot_table("a2", 64) == [1, 0]
    assert refs(m) == {0: (1, 0), 6: (1, 0)}
    assert locate(m, [1, 2, 3, 4]) == [("d", 1), ("d", 2), ("s", 0), ("s", 1)]
    assert_request_kv(m, "a2", A, 4)
    s = m.stats()
    assert (s.offloads, s.onboards, s.disk_offloads, s.disk_onboards) == (5, 1, 3, 1)
    assert s.disk_bytes_read == m.slot_bytes(64) and s.prefix_hit_tokens == 4
    m.check_integrity()
    m.release("a2")
    written(m)
    assert book.assert_cached_blocks(m) == 5


def test_a_hit_moves_its_rows_in_one_copy_each_way_before_any_write_is_queued(disk, monkeypatch):
    """The hit of a2 (as above) evicts b and c from the host pool to disk and promotes a's block, in
    one step (kvcache/pool.py `_steps`): b's and c's rows go out in one copy, a's bytes come in by
    one, and the writes of b and c are queued only after every copy of the call (on the H200, copies
    with the writers hashing alongside were many times slower: docs/BENCHMARKS.md)."""
    import kvcache.disk_pool as disk_pool
    from kvcache.disk_store import DiskStore

    m = disk()
    push_a_to_disk(m)
    events: list[str] = []
    copy_rows, write = disk_pool.copy_rows, DiskStore.write
    monkeypatch.setattr(disk_pool, "copy_rows", lambda dst, src: (events.append(f"copy {len(dst)}"),
                                                                   copy_rows(dst, src))[1])
    monkeypatch.setattr(DiskStore, "write", lambda self, *args: (events.append("write"), write(self, *args))[1])
    assert m.admit("a2", A + [9]) == 4
    assert events == ["copy 2", "copy 1", "write", "write"]  # b and c out, a in; then their writes
    assert_request_kv(m, "a2", A, 4)
    m.check_integrity()


@pytest.mark.parametrize(("damage", "reason"), [
    (lambda p: p.write_bytes(p.read_bytes()[:-1] + bytes([p.read_bytes()[-1] ^ 1])), "corrupt"),
    (lambda p: p.write_bytes(p.read_bytes()[:-10]), "truncated"),
    (lambda p: p.write_bytes(p.read_bytes()[:20] + b"x" + p.read_bytes()[21:]), "corrupt"),
    (lambda p: p.unlink(), "missing"),
])
def test_a_damaged_file_is_dropped_and_the_prompt_computed(disk, tmp_path, caplog, damage, reason):
    m = disk()
    push_a_to_disk(m)
    damage(tmp_path / "kv" / "w64" / "0.kv")
    with caplog.at_level(logging.WARNING, logger="kvcache.disk_tier"):
        assert run_prefill(m, "a2", A + [9]) == 0  # computed, not served
    assert f"window 64 slot 0 dropped: {reason}" in caplog.text
    assert m.stats().disk_dropped == {reason: 1} and m.stats().disk_onboards == 0
    assert block_hashes(A, 4, "fp")[0] in m.cached_block_hashes()  # a2's own, computed copy
    assert locate(m, m.block_ids("a2"))[0][0] == "p"
    assert not (tmp_path / "kv" / "w64" / "0.kv").exists()
    assert_request_kv(m, "a2", A + [9], 5)
    m.check_integrity()


def test_a_file_holding_another_block_is_stale(disk, tmp_path):
    m = disk()
    push_a_to_disk(m)
    m.admit("a2", A + [9])  # b and c go down to d1, d2
    m.release("a2")
    written(m)
    folder = tmp_path / "kv" / "w64"
    shutil.copy(folder / "2.kv", folder / "1.kv")  # a valid file, of c, in b's slot
    assert run_prefill(m, "b2", B + [9]) == 0
    assert m.stats().disk_dropped == {"stale": 1}
    m.check_integrity()


def test_a_restarted_manager_finds_its_blocks_and_serves_them(disk):
    first = disk()
    push_a_to_disk(first)
    first.close()
    again = disk()
    a_hash = block_hashes(A, 4, "fp")[0]
    assert again.cached_blocks()[64][Level.DISK] == [a_hash]
    assert again.stats().disk_restored == 1 and locate(again, [4]) == [("d", 0)]  # disk block 4 owns slot 0
    assert again.admit("a2", A + [9]) == 4
    assert_request_kv(again, "a2", A, 4)
    assert again.stats().disk_onboards == 1
    again.check_integrity()


@pytest.mark.parametrize(("change", "why"), [
    ({"key": b"another token's key"}, "written under another deployment token"),
    ({"salt": "another model"}, "fingerprint is 'fp', this server has 'another model'"),
])
def test_a_manifest_of_another_model_or_token_is_ignored(disk, tmp_path, caplog, change, why):
    first = disk()
    push_a_to_disk(first)
    first.close()
    with caplog.at_level(logging.WARNING, logger="kvcache.disk_dir"):
        again = disk(**change)
    assert f"ignoring its 1 block files (manifest {why}" in caplog.text.replace("manifest: ", "manifest ")
    assert again.cached_blocks()[64][Level.DISK] == [] and again.stats().disk_restored == 0
    assert not (tmp_path / "kv" / "w64" / "0.kv").exists()
    assert run_prefill(again, "a2", A + [9]) == 0


def test_a_manifest_of_another_layout_is_ignored(disk, tmp_path, open_managers, caplog):
    first = disk()
    push_a_to_disk(first)
    first.close()
    with caplog.at_level(logging.WARNING, logger="kvcache.disk_dir"):
        other = make_manager("cpu", tpb=8, primary_blocks=2, host_blocks=2, disk_blocks=3,
                             disk_dir=str(tmp_path / "kv"), disk_key=KEY, salt="fp")
    open_managers.append(other)
    assert "manifest: tokens_per_block is 4, this server has 8" in caplog.text
    assert other.cached_blocks()[64][Level.DISK] == []


def test_kv_events_carry_the_disk_level_to_the_routers_index(disk):
    from server.router.kv_index import KvIndex

    m = disk()
    m.enable_events()
    index = KvIndex()
    index.reset({"salt": "fp", "tokens_per_block": 4, "windows": {"64": {}}})
    push_a_to_disk(m)
    for window, kind, block_hash, level in m.drain_events():
        index.apply(window, kind, block_hash, level)
    assert index.match(block_hashes(A, 4, "fp")) == [Level.DISK]
    assert index.match(block_hashes(E, 4, "fp")) == [Level.PRIMARY]
    m.admit("a2", A + [9])
    for event in m.drain_events():
        index.apply(*event)
    assert index.match(block_hashes(A, 4, "fp")) == [Level.PRIMARY]
    assert index.counts[64, Level.DISK] == 2  # b and c went down in its place


def test_one_directory_serves_one_manager(disk):
    disk()
    with pytest.raises(ValueError, match=r"kv_cache_config.disk.path=.*another server uses this directory"):
        disk()


def test_a_full_write_queue_drops_the_block_instead(disk, tmp_path):
    m = disk(write_queue_bytes=1)
    push_a_to_disk(m)
    assert m.stats().disk_dropped == {"queue_full": 1}
    assert block_hashes(A, 4, "fp")[0] not in m.cached_block_hashes()
    assert not (tmp_path / "kv" / "w64" / "0.kv").exists()
    m.check_integrity()


def test_ensure_primary_and_pin_bring_disk_blocks_up(disk):
    m = disk()
    book = PrefixBook(4, salt="fp")
    push_a_to_disk(m, book)
    m.pin_blocks([0], 64)
    assert locate(m, [0]) == [("p", 1)] and refs(m) == {0: (0, 1)}
    assert book.assert_cached_blocks(m) == 5
    m.unpin_blocks([0], 64)
    m.check_integrity()


def test_ensure_primary_of_a_block_whose_file_failed_raises(disk, tmp_path):
    m = disk()
    push_a_to_disk(m)
    (tmp_path / "kv" / "w64" / "0.kv").write_bytes(b"PDKVBLK1 garbage")
    with pytest.raises(KVCacheError, match=r"blocks \[0\] were on disk, and a file they need failed its check"):
        m.ensure_primary([0], 64)
    assert m.stats().disk_dropped == {"corrupt": 1}
    m.check_integrity()


def _cache(bm: BlockManager, name: bytes, priority: int) -> None:
    """A one-block prompt computed and released (evicts the primary's LRU leaf when it is full)."""
    b = bm.allocate(priority)
    bm.insert(b, name, None, (name[0],), b"salt")
    bm.release(b)


def test_the_disk_level_evicts_lowest_priority_then_least_recently_used():
    bm = BlockManager(1, 1, 2, offload_min_priority=0)
    bm.events = []
    for name, priority in ((b"a", 80), (b"b", 10), (b"c", 50), (b"d", 50)):
        _cache(bm, name, priority)
    # every prompt pushed the one before it to the host, and that host block's predecessor to disk
    assert [(b.hash, b.level) for b in bm.tree.by_hash.values()] == [
        (b"a", Level.DISK), (b"b", Level.DISK), (b"c", Level.SECONDARY), (b"d", Level.PRIMARY)]
    for name in (b"e", b"f", b"g"):
        _cache(bm, name, 50)
    # the disk kept a (80) while b (10) went first, then c and d (50) in the order they were used
    assert [h for kind, h, level in bm.events if kind == REMOVED] == [b"b", b"c", b"d"]
    assert {h: b.level for h, b in bm.tree.by_hash.items()} == {
        b"a": Level.DISK, b"e": Level.DISK, b"f": Level.SECONDARY, b"g": Level.PRIMARY}
    # b..g each evicted the primary's block (6), c..g the host's too (5: all went down to disk), and
    # e..g a disk block (3)
    assert bm.moved[Level.SECONDARY, Level.DISK] == 5 and bm.evictions == 6 + 5 + 3


def test_the_tier_opens_with_buffers_for_a_hit_of_the_whole_host_pool(disk):
    m = disk(host=2, write_queue_bytes=1 << 20)
    slot_bytes = m._groups[0].pools.slot_bytes
    assert m._disk.store.buffers.free_bytes == 2 * 2 * slot_bytes  # 2 host blocks: reads + displaced writes
    push_a_to_disk(m)
    hits = m.admit("again", A + [1])  # a's block comes up from disk through the reserved buffers
    assert hits == len(A) and m.stats().disk_onboards == 1
