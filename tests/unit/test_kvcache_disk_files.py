"""The disk tier's file format, manifest, store and buffers on their own (kvcache/disk_format.py,
disk_store.py, disk_buffers.py), and the order in which found blocks are restored (disk_tier._entries)."""

from __future__ import annotations

import pytest
from waiting import wait_until

from kvcache.config import DiskTierConfig
from kvcache.disk_buffers import BufferPool
from kvcache.disk_format import (
    CHUNK_BYTES,
    BadFile,
    BlockHeader,
    Manifest,
    check_digest,
    decode_header,
    encode_prefix,
    key_id,
    open_manifest,
    payload_hasher,
    seal_manifest,
)
from kvcache.disk_store import BlockMeta, DiskStore
from kvcache.disk_tier import _entries

KEY = b"k" * 32


def payload_mac(payload: bytes | memoryview) -> bytes:
    h = payload_hasher(KEY)
    h.update(payload)
    return h.digest()


def _header(payload: bytes, **kw) -> BlockHeader:
    fields = dict(window=64, slot=3, block_hash=b"h" * 16, parent_hash=None, root_salt=b"s" * 16,
                  tokens=(1, 2, 3, 4), priority=35, written_ns=1, payload_bytes=len(payload),
                  payload_mac=payload_mac(payload), dtype="float32", scales=())
    return BlockHeader(**{**fields, **kw})


def test_a_block_file_round_trips_and_any_change_fails_its_check():
    payload = bytes(range(256))
    data = encode_prefix(KEY, _header(payload)) + payload
    header, offset = decode_header(KEY, data)
    assert header == _header(payload) and data[offset:] == payload
    check_digest(header, payload_mac(memoryview(data)[offset:]))
    with pytest.raises(BadFile, match="header MAC mismatch") as other_key:
        decode_header(b"other", data)
    assert other_key.value.reason == "corrupt"
    flipped = bytearray(data)
    flipped[-1] ^= 0x80
    with pytest.raises(BadFile, match="payload checksum mismatch"):
        check_digest(header, payload_mac(memoryview(flipped)[offset:]))
    with pytest.raises(BadFile, match="not a pdserve KV block file"):
        decode_header(KEY, b"x" * 64)


def test_a_manifest_opens_only_under_its_key_and_unedited():
    manifest = Manifest(1, "fp", "float32", 4, (64,), 2, 4, key_id(KEY))
    sealed = seal_manifest(KEY, manifest)
    assert open_manifest(KEY, sealed) == manifest
    with pytest.raises(ValueError, match="written under another deployment token"):
        open_manifest(b"other", sealed)
    with pytest.raises(ValueError, match="MAC does not match"):
        open_manifest(KEY, sealed.replace(b'"fp"', b'"fq"'))
    with pytest.raises(ValueError, match="unreadable"):
        open_manifest(KEY, b"{")


def test_a_queued_write_answers_reads_until_its_file_lands(tmp_path):
    config = DiskTierConfig(path=str(tmp_path), max_bytes=1 << 20)
    store = DiskStore(tmp_path, KEY, config, {64: 8})  # not opened: its writer threads wait
    (tmp_path / "w64").mkdir()
    meta = BlockMeta(b"h" * 16, None, b"s" * 16, (1,), 35)
    assert store.write(64, 0, meta, memoryview(bytearray(b"12345678")))
    assert bytes(store.read_many([(64, 0, b"h" * 16)])[0]) == b"12345678"  # from the queue
    assert store.read_many([(64, 0, b"g" * 16)])[0].reason == "stale"
    assert store.read_many([(64, 1, b"h" * 16)])[0].reason == "missing"
    for writer in store._writers:
        writer.start()
    wait_until(lambda: store.stats.bytes_written == 8, 10, what="the write to land")
    assert not store._pending and store.stats.queued_bytes == 0
    assert bytes(store.read_many([(64, 0, b"h" * 16)])[0]) == b"12345678"  # from the file
    store.close()


def test_found_blocks_are_restored_parents_first_newest_copy_and_no_orphans():
    def h(name: bytes, parent: bytes | None, slot: int, written: int) -> BlockHeader:
        return _header(b"", block_hash=name * 16, parent_hash=parent and parent * 16, slot=slot,
                       written_ns=written)

    headers = [h(b"c", b"b", 0, 5), h(b"b", b"a", 1, 9), h(b"a", None, 2, 7), h(b"a", None, 3, 1),
               h(b"x", b"q", 4, 2), h(b"y", b"x", 5, 3)]  # q has no file: x and y are orphans
    assert [(slot, name[:1]) for slot, name, *_ in _entries(headers)] == [(2, b"a"), (1, b"b"), (0, b"c")]


def _store(tmp_path, slot_bytes: int) -> DiskStore:
    config = DiskTierConfig(path=str(tmp_path), max_bytes=1 << 30)
    store, _ = DiskStore.open(config, KEY, Manifest(2, "fp", "float16", 4, (64,), 2, 4, key_id(KEY)),
                              {64: (4, slot_bytes)})
    return store


def test_a_payload_of_many_pieces_round_trips_and_a_flip_in_any_piece_fails(tmp_path):
    n = 3 * CHUNK_BYTES + 5  # the last piece is short
    payload = bytes(i * 7 % 251 for i in range(n))
    store = _store(tmp_path, n)
    meta = BlockMeta(b"h" * 16, None, b"s" * 16, (1,), 35)
    try:
        assert store.write(64, 0, meta, memoryview(bytearray(payload)))
        wait_until(lambda: store.stats.bytes_written == n, 10, what="the write to land")
        (got,) = store.read_many([(64, 0, b"h" * 16)])
        assert isinstance(got, memoryview) and bytes(got) == payload
        path = tmp_path / "w64" / "0.kv"
        good = path.read_bytes()
        header, offset = decode_header(KEY, good)
        assert header.payload_mac == payload_mac(payload) and len(good) == offset + n
        for at in (offset, offset + CHUNK_BYTES + 1, len(good) - 1):  # first, middle and last piece
            flipped = bytearray(good)
            flipped[at] ^= 1
            path.write_bytes(flipped)
            assert store.read_many([(64, 0, b"h" * 16)])[0].reason == "corrupt"
        for bad, reason in ((good[:-1], "truncated"), (good + b"x", "truncated")):  # shorter or longer
            path.write_bytes(bad)
            assert store.read_many([(64, 0, b"h" * 16)])[0].reason == reason
    finally:
        store.close()


def test_buffers_are_reused_given_back_once_and_only_whole():
    pool = BufferPool(max_free_bytes=3 * 8)
    a = pool.take(8)
    pool.give(memoryview(a)[:4])  # part of a buffer: not taken back
    pool.give(b"12345678")  # not a buffer of the pool's kind
    assert pool.free_bytes == 0
    pool.give(memoryview(a))
    assert pool.free_bytes == 8 and pool.take(8) is a and pool.free_bytes == 0
    for buf in [bytearray(8) for _ in range(4)]:
        pool.give(buf)
    assert pool.free_bytes == 24  # beyond max_free_bytes: left to the garbage collector


def test_a_superseded_write_gives_its_buffer_back_and_a_read_from_the_queue_is_a_copy(tmp_path):
    config = DiskTierConfig(path=str(tmp_path), max_bytes=1 << 20)
    store = DiskStore(tmp_path, KEY, config, {64: 8})  # not opened: its writer threads wait
    (tmp_path / "w64").mkdir()
    meta = BlockMeta(b"h" * 16, None, b"s" * 16, (1,), 35)
    first, second = bytearray(b"11111111"), bytearray(b"22222222")
    assert store.write(64, 0, meta, first) and store.write(64, 0, meta, second)
    assert store.buffers.free_bytes == 8 and store.buffers.take(8) is first  # no writer had it
    (queued,) = store.read_many([(64, 0, b"h" * 16)])
    assert bytes(queued) == b"22222222" and queued.obj is not second  # the writer gives `second` back
    for writer in store._writers:
        writer.start()
    wait_until(lambda: store.stats.bytes_written == 8, 10, what="the write to land")
    assert bytes(store.read_many([(64, 0, b"h" * 16)])[0]) == b"22222222"
    store.close()


def test_reserve_fills_the_pool_within_its_bound():
    pool = BufferPool(max_free_bytes=3 * 8)
    assert pool.reserve(8, 2) == 2 and pool.free_bytes == 16
    assert pool.reserve(8, 5) == 1 and pool.free_bytes == 24  # max_free_bytes reached
    taken = [pool.take(8) for _ in range(3)]
    assert pool.free_bytes == 0 and len({id(b) for b in taken}) == 3 and all(len(b) == 8 for b in taken)
