"""An FP8 KV cache in kvcache/, exact state: the layout (one byte an element, per-layer scales rounded
to float32), the pools (float8 slots: twice bf16's blocks in the same host and disk bytes), block
copies that move the bytes unchanged, the hash namespace (another dtype or other scales never
match), the scales file, and the disk tier (the manifest and every file name the format; a file of
another format is never served; a restart finds FP8 blocks again)."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import msgspec
import pytest
import torch
from waiting import wait_until

from kvcache import CacheLayout, KvCacheConfig, KVCacheManager, KVFormat, Level, block_hashes
from kvcache.block import CopyOp
from kvcache.config import DiskTierConfig
from kvcache.disk_format import BlockFormat, Manifest, key_id
from kvcache.disk_store import BlockMeta, DiskStore
from kvcache.group import level_sizes
from kvcache.hashing import kv_format_salt
from kvcache.kv_scales import as_float32, read_scales, write_scales

FP8 = torch.float8_e4m3fn
KEY = bytes(range(32))
TPB = 4


def layout(dtype: torch.dtype = FP8, **scales) -> CacheLayout:
    """Two layers (window 64), 2 kv heads of 32: 256 bytes a token in FP8."""
    return CacheLayout((64, 64), KVFormat(dtype, 2, 32, **scales), "cpu", 64)


def test_fp8_slots_are_half_of_bf16_and_a_quarter_of_float32_with_per_layer_scales():
    assert [layout(d).bytes_per_token() for d in (torch.float32, torch.bfloat16, FP8)] == [1024, 512, 256]
    fp8 = layout()
    assert fp8.format.quantized and (fp8.format.k_scales, fp8.format.v_scales) == ((1.0, 1.0), (1.0, 1.0))  # none: 1.0
    scaled = layout(k_scales=(0.1, 0.02), v_scales=(3.0, 0.5))
    f = scaled.format
    assert f.k_scales == (as_float32(0.1), as_float32(0.02)) and f.k_scales[0] != 0.1
    assert f.layer_scales(1) == (as_float32(0.02), 0.5) and layout(torch.bfloat16).format.layer_scales(0) == (1.0, 1.0)
    assert f.block_scales((0, 1)) == (*f.k_scales, *f.v_scales) and layout(torch.float32).format.block_scales(
        (0, 1)) == ()
    assert layout(torch.float32).format.hash_namespace == "" and f.hash_namespace.startswith("float8_e4m3fn:")
    assert f.hash_namespace != fp8.format.hash_namespace and f.id != fp8.format.id
    with pytest.raises(ValueError, match="k/v scales are for an FP8 cache, not bfloat16"):
        layout(torch.bfloat16, k_scales=(1.0, 1.0))
    with pytest.raises(ValueError, match=r"k_scales: 1 values for 2 layers"):
        layout(k_scales=(1.0,))
    with pytest.raises(ValueError, match=r"v_scales\[1\]=0.0: a scale must be a finite number > 0"):
        layout(v_scales=(1.0, 0.0))


def _config(host_bytes: int, disk_bytes: int, tmp_path) -> KvCacheConfig:
    return KvCacheConfig(tokens_per_block=TPB, max_tokens=8 * TPB, host_cache_size=host_bytes,
                         disk=DiskTierConfig(path=str(tmp_path), max_bytes=disk_bytes))


def test_the_same_host_and_disk_bytes_hold_twice_the_fp8_blocks_of_bf16(tmp_path):
    config = _config(16 * 2048, 64 * 2048, tmp_path)  # a bf16 block of both layers: 4 x 512 = 2048 bytes
    assert level_sizes(config, layout(torch.bfloat16)) == (8, 16, 64)
    assert level_sizes(config, layout()) == (8, 32, 128)
    assert level_sizes(config, layout(torch.float32)) == (8, 8, 32)
    m = KVCacheManager(KvCacheConfig(tokens_per_block=TPB, max_tokens=8 * TPB, host_cache_size=16 * 2048),
                       layout(k_scales=(0.5, 0.25)))
    primary, host = m.pool(64), m.pool(64, Level.SECONDARY)
    assert (primary.dtype, tuple(primary.shape), m.slot_bytes(64)) == (FP8, (8, 2, 2, TPB, 2, 32), 1024)
    assert tuple(host.shape) == (32, 2, 2, TPB, 2, 32) and host.nbytes == 16 * 2048
    assert m.layout.format.layer_scales(1) == (0.25, 1.0) and m.num_slots(64, Level.SECONDARY) == 32


def _pattern(seed: int, nbytes: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(str(seed).encode()).digest()[:7], "little"))
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def _slot_bytes(pool: torch.Tensor, slot: int) -> torch.Tensor:
    return pool[slot].view(-1).view(torch.uint8)


def test_copies_between_primary_and_host_move_fp8_bytes_unchanged():
    m = KVCacheManager(KvCacheConfig(tokens_per_block=TPB, max_tokens=8 * TPB, host_cache_size=4 * 1024),
                       layout(k_scales=(0.5, 0.25)))
    pools = m._group(64).pools
    for slot in range(8):
        _slot_bytes(m.pool(64), slot).copy_(_pattern(slot, 1024))
    pools.execute([CopyOp(Level.PRIMARY, 3, Level.SECONDARY, 0), CopyOp(Level.PRIMARY, 5, Level.SECONDARY, 2),
                   CopyOp(Level.SECONDARY, 0, Level.PRIMARY, 6), CopyOp(Level.PRIMARY, 1, Level.PRIMARY, 7)])
    host = m.pool(64, Level.SECONDARY)
    assert torch.equal(_slot_bytes(host, 0), _pattern(3, 1024)) and torch.equal(_slot_bytes(host, 2), _pattern(5, 1024))
    assert torch.equal(_slot_bytes(m.pool(64), 6), _pattern(3, 1024))
    assert torch.equal(_slot_bytes(m.pool(64), 7), _pattern(1, 1024))
    assert all(torch.equal(_slot_bytes(m.pool(64), s), _pattern(s, 1024)) for s in (0, 1, 2, 3, 4, 5))


def test_blocks_of_another_dtype_or_other_scales_never_share_a_hash():
    tokens = list(range(1, 13))
    managers = [KVCacheManager(KvCacheConfig(tokens_per_block=TPB, max_tokens=8 * TPB), lay, salt="model-A")
                for lay in (layout(torch.float32), layout(), layout(k_scales=(0.5, 1.0)))]
    salts = [m.salt for m in managers]
    assert salts[0] == "model-A" and salts[1] == kv_format_salt("model-A", layout().format)
    assert len(set(salts)) == 3 and salts[1].startswith("model-A\x1ekv=float8_e4m3fn:")
    hashes = []
    for m in managers:
        m.admit("r", tokens)
        m.commit("r", tokens, len(tokens))
        assert m.cached_block_hashes() == block_hashes(tokens, TPB, m.salt)  # what the router computes
        hashes.append(set(m.cached_block_hashes()))
    assert not (hashes[0] & hashes[1] or hashes[1] & hashes[2] or hashes[0] & hashes[2])


def test_the_hashing_and_the_scales_file_need_no_torch():
    """The router and the deployment checks import them: no torch in their processes."""
    code = ("import sys; import kvcache.hashing, kvcache.kv_scales, kvcache.config, server.config.schema; "
            "from kvcache import block_hashes, request_salt; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


def test_a_scales_file_round_trips_as_float32_and_a_bad_one_is_named(tmp_path):
    path = tmp_path / "scales.json"
    write_scales(path, [0.1, 0.02], [3.0, 0.5], model="m", tokens=7)
    assert read_scales(path, 2) == ((as_float32(0.1), as_float32(0.02)), (3.0, 0.5))
    assert msgspec.json.decode(path.read_bytes())["format"] == "pdserve-kv-scales"
    with pytest.raises(ValueError, match=r"scales.json': k_scale: 2 values for 4 layers"):
        read_scales(path, 4)
    path.write_text('{"format": "pdserve-kv-scales", "version": 1, "dtype": "float8_e4m3fn", '
                    '"k_scale": [1.0, -2.0], "v_scale": [1.0, 1.0]}')
    with pytest.raises(ValueError, match=r"k_scale\[1\]=-2.0: a scale must be a finite number > 0"):
        read_scales(path, 2)
    with pytest.raises(ValueError, match="cannot read it"):
        read_scales(tmp_path / "missing.json")
    assert KvCacheConfig(dtype="fp8", scales=str(path)).scales == str(path)
    with pytest.raises(ValueError, match="scales: .* is for an FP8 cache .* the dtype is 'auto'"):
        KvCacheConfig(scales=str(path))


def _store(tmp_path, fmt: BlockFormat, *, opened: bool) -> DiskStore:
    config = DiskTierConfig(path=str(tmp_path), max_bytes=1 << 20)
    if not opened:  # its writer threads wait; nothing is scanned
        return DiskStore(tmp_path, KEY, config, {64: 8}, {64: fmt})
    manifest = Manifest(3, "fp", "float8_e4m3fn", TPB, (64,), 2, 4, key_id(KEY))
    store, _ = DiskStore.open(config, KEY, manifest, {64: (4, 8)}, {64: fmt})
    return store


def test_a_block_file_of_another_format_is_never_served_nor_restored(tmp_path):
    fp8 = BlockFormat("float8_e4m3fn", (0.5, 0.25))
    store = _store(tmp_path, fp8, opened=True)
    assert store.write(64, 0, BlockMeta(b"h" * 16, None, b"s" * 16, (1,), 35), memoryview(bytearray(b"12345678")))
    wait_until(lambda: store.stats.bytes_written == 8, 10, what="the write to land")
    assert bytes(store.read_many([(64, 0, b"h" * 16)])[0]) == b"12345678"
    store.close()
    for other in (BlockFormat("float8_e4m3fn", (0.5, 0.5)), BlockFormat("bfloat16")):
        (got,) = _store(tmp_path, other, opened=False).read_many([(64, 0, b"h" * 16)])
        assert got.reason == "format" and "the file holds float8_e4m3fn with scales [0.5, 0.25] KV" in str(got)
    again = _store(tmp_path, BlockFormat("float8_e4m3fn", (0.5, 0.5)), opened=True)  # the same manifest
    assert again.stats.skipped_at_start == {"format": 1} and not (tmp_path / "w64" / "0.kv").exists()
    again.close()


def _disk_manager(tmp_path, lay: CacheLayout) -> KVCacheManager:
    block = TPB * lay.bytes_per_token()
    config = KvCacheConfig(tokens_per_block=TPB, max_tokens=2 * TPB, host_cache_size=2 * block,
                           secondary_offload_min_priority=0,
                           disk=DiskTierConfig(path=str(tmp_path / "kv"), max_bytes=4 * block))
    return KVCacheManager(config, lay, salt="fp", disk_key=KEY)


def _prefill(m: KVCacheManager, rid: str, tokens: list[int], seed: int) -> None:
    m.admit(rid, tokens)
    _slot_bytes(m.pool(64), m.slot_table(rid, 64)[0]).copy_(_pattern(seed, m.slot_bytes(64)))
    m.commit(rid, tokens, len(tokens))
    m.release(rid)


def test_fp8_blocks_on_disk_are_found_again_by_the_same_format_only(tmp_path, caplog):
    scaled = layout(k_scales=(0.5, 0.25))
    m = _disk_manager(tmp_path, scaled)
    for i in range(5):  # a 2-block primary and a 2-block host pool: the first prompt's block goes to disk
        _prefill(m, f"r{i}", [i + 1] * TPB, i)
    m.close()
    again = _disk_manager(tmp_path, scaled)
    assert again.stats().disk_restored == 1
    assert again.admit("a", [1] * TPB + [9]) == TPB  # read back from its file
    assert torch.equal(_slot_bytes(again.pool(64), again.slot_table("a", 64)[0]), _pattern(0, again.slot_bytes(64)))
    again.close()
    for lay in (layout(k_scales=(0.5, 0.5)), layout(torch.bfloat16)):  # other scales, another dtype
        other = _disk_manager(tmp_path, lay)
        assert other.stats().disk_restored == 0 and other.admit("a", [1] * TPB + [9]) == 0
        other.close()
    assert "ignoring its" in caplog.text and "manifest: " in caplog.text
