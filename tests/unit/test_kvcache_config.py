"""KvCacheConfig / CacheLayout validation, pool sizing, and block hashes."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from kv_factories import make_manager

from kvcache import (
    CacheLayout,
    KvCacheConfig,
    KVCacheError,
    KVCacheManager,
    KVFormat,
    Level,
    block_hashes,
    request_salt,
)
from server.config.schema import ConfigError, server_config_from_dict


@pytest.mark.parametrize(("key", "value", "why"), [
    ("tokens_per_block", 0, "must be >= 1, got 0"),
    ("tokens_per_block", 4.0, "must be an integer, got a number 4.0"),
    ("max_tokens", 16, r"16 is below one block \(tokens_per_block=32\)"),
    ("max_tokens", -32, "must be >= 1, got -32"),
    ("free_gpu_memory_fraction", 1.5, "must be <= 1, got 1.5"),
    ("free_gpu_memory_fraction", 0, "must be > 0, got 0"),
    ("gpu_memory_share", 1.2, "must be <= 1, got 1.2"),
    ("enable_block_reuse", "yes", "must be true or false, got a string 'yes'"),
    ("host_cache_size", -1, "must be >= 0, got -1"),
    ("secondary_offload_min_priority", 101, "must be <= 100, got 101"),
    ("tokens_per_blocks", 32, r"unknown key \(did you mean 'tokens_per_block'\?\)"),
])
def test_yaml_errors_name_file_key_and_value(key, value, why):
    with pytest.raises(ConfigError, match=rf"^ctx\.yaml: kv_cache_config\.{key}: {why}"):
        server_config_from_dict({"model": "m", "kv_cache_config": {key: value}}, "ctx.yaml")


@pytest.mark.parametrize(("disk", "why"), [
    ({"path": "/d", "max_bytes": 1 << 20}, r"kv_cache_config\.disk: needs a host pool \(host_cache_size > 0\)"),
    ({"path": "", "max_bytes": 1, "x": 0}, r"kv_cache_config\.disk\.path: must be a non-empty string"),
    ({"path": "/d"}, r"kv_cache_config\.disk\.max_bytes: required"),
    ({"path": "/d", "max_bytes": 1, "read_threads": 0}, r"kv_cache_config\.disk\.read_threads: must be >= 1"),
    ({"path": "/d", "max_bytes": 1, "paths": 1}, r"kv_cache_config\.disk\.paths: unknown key"),
])
def test_disk_tier_errors_name_file_and_key(disk, why):
    host = {} if "needs a host pool" in why else {"host_cache_size": 1 << 20}
    with pytest.raises(ConfigError, match=rf"^ctx\.yaml: {why}"):
        server_config_from_dict({"model": "m", "kv_cache_config": {"disk": disk, **host}}, "ctx.yaml")


def test_a_disk_tier_too_small_for_one_block_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"kv_cache_config.disk.max_bytes=100: holds no block \(one block of every "
                                         r"layer is 256 bytes\)"):
        make_manager("cpu", host_blocks=2, disk_blocks=1, disk_dir=str(tmp_path), disk={"max_bytes": 100})


def test_constructor_checks_across_fields_and_yaml_values_convert():
    with pytest.raises(ValueError, match=r"^max_tokens: 16 is below one block \(tokens_per_block=32\)"):
        KvCacheConfig(max_tokens=16)
    data = {"max_tokens": 1024, "tokens_per_block": 32, "host_cache_size": 268435456,
            "secondary_offload_min_priority": 0, "free_gpu_memory_fraction": 1}
    cfg = server_config_from_dict({"model": "m", "kv_cache_config": data}, "ctx.yaml").kv_cache_config
    assert (cfg.max_tokens, cfg.host_cache_size, cfg.secondary_offload_min_priority) == (1024, 268435456, 0)
    assert cfg.free_gpu_memory_fraction == 1.0 and isinstance(cfg.free_gpu_memory_fraction, float)
    assert cfg.enable_block_reuse and cfg.enable_partial_reuse and cfg.copy_on_partial_reuse


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"layer_windows": (64, 65)},
     r"layer_windows\[1\]=65: layer 1's window must be an integer in \[1, max_seq_len=64\]"),
    ({"layer_windows": ()}, "needs at least one layer"),
    ({"num_kv_heads": 0}, r"num_kv_heads=0: must be an integer > 0"),
    ({"head_dim": 2.5}, r"head_dim=2.5"),
    ({"dtype": "float16"}, "must be a torch.dtype"),
    ({"device": "nodevice"}, "device='nodevice'"),
])
def test_layout_errors_name_the_field(kwargs, match):
    fmt = dict(num_kv_heads=2, head_dim=4, dtype=torch.float32)
    args = dict(layer_windows=(64,), device="cpu", max_seq_len=64)
    with pytest.raises(ValueError, match=match):
        CacheLayout(**{k: v for k, v in {**args, **kwargs}.items() if k not in fmt},
                    format=KVFormat(**{**fmt, **{k: v for k, v in kwargs.items() if k in fmt}}))


def test_sizing_per_group_from_max_tokens_and_host_bytes():
    layout = CacheLayout((32, 64, 64), KVFormat(torch.float16, 2, 8), "cpu", 64)
    assert layout.bytes_per_token() == 3 * 2 * 2 * 8 * 2 == 192
    cfg = KvCacheConfig(tokens_per_block=4, max_tokens=40, host_cache_size=192 * 4 * 5 + 100)
    m = KVCacheManager(cfg, layout)
    for w, layers in ((32, 1), (64, 2)):
        assert (m.num_slots(w), m.num_slots(w, Level.SECONDARY)) == (10, 5)
        assert m.slot_bytes(w) == layers * 2 * 4 * 2 * 8 * 2
    cpu_default = KVCacheManager(KvCacheConfig(tokens_per_block=4), layout)
    assert cpu_default.num_slots(64) == 8 * 64 // 4  # CPU without max_tokens: 8 * max_seq_len tokens
    assert cpu_default.pool(64, Level.SECONDARY) is None


def test_host_cache_smaller_than_one_block_is_an_error():
    layout = CacheLayout((64,), KVFormat(torch.float16, 2, 8), "cpu", 64)  # 64 bytes per token, 256 per block
    with pytest.raises(ValueError, match=r"host_cache_size=255: holds no block \(one block .* is 256 bytes\)"):
        KVCacheManager(KvCacheConfig(tokens_per_block=4, max_tokens=16, host_cache_size=255), layout)
    m = KVCacheManager(KvCacheConfig(tokens_per_block=4, max_tokens=16, host_cache_size=256), layout)
    assert m.num_slots(64, Level.SECONDARY) == 1


def test_block_hashes_chain_and_salt():
    toks = list(range(70))
    h = block_hashes(toks, 32)
    assert len(h) == 2 and all(len(x) == 16 for x in h)
    assert block_hashes(toks[:64], 32) == h and block_hashes(toks[:40], 32) == h[:1]
    assert block_hashes([99] + toks[1:], 32)[1] != h[1]  # the chain carries the first block
    assert block_hashes(toks, 32, "m")[0] != h[0]
    assert request_salt("m", None) == "m" and request_salt("m", "lora") != "m"
    # a fixed value: the router and other processes recompute these hashes, so the definition is frozen
    assert h[0].hex() == "03599aa98457e63b0626ac610bd17fde"
    with pytest.raises(ValueError, match="tokens_per_block=0"):
        block_hashes(toks, 0)


def _hash_in_subprocess() -> str:
    code = "from kvcache import block_hashes; print(block_hashes(list(range(70)), 32)[0].hex())"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={"PYTHONHASHSEED": "123", "PATH": ""}).stdout.strip()


def test_block_hashes_are_the_same_in_another_process():
    assert block_hashes(list(range(70)), 32)[0].hex() == _hash_in_subprocess()


def test_manager_uses_the_router_visible_hashes():
    m = make_manager("cpu", salt="fp")
    m.admit("a", list(range(9)))
    m.commit("a", list(range(9)), 9)
    assert m.cached_block_hashes() == block_hashes(list(range(9)), 4, request_salt("fp", None))


def test_a_pool_sized_from_free_gpu_memory_is_capped_in_blocks(monkeypatch):
    """A tiny model on a large GPU gets MAX_AUTO_BLOCKS blocks, not millions (each block is a Python
    object: millions took ~30 s to build); an 8B-sized layout is below the cap; max_tokens overrides."""
    from kvcache.group import MAX_AUTO_BLOCKS, primary_tokens

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (140 << 30, 141 << 30))
    tiny = CacheLayout(layer_windows=(2048,) * 2, format=KVFormat(torch.bfloat16, 2, 64),
                       device="cuda", max_seq_len=2048)
    big = CacheLayout(layer_windows=(8192,) * 32, format=KVFormat(torch.bfloat16, 8, 128),
                      device="cuda", max_seq_len=8192)
    cfg = KvCacheConfig(tokens_per_block=32, free_gpu_memory_fraction=0.9)
    assert primary_tokens(cfg, tiny) == MAX_AUTO_BLOCKS * 32
    assert primary_tokens(cfg, big) == int(0.9 * (140 << 30)) // big.bytes_per_token() < MAX_AUTO_BLOCKS * 32
    assert primary_tokens(KvCacheConfig(tokens_per_block=32, max_tokens=1 << 24), tiny) == 1 << 24


def test_servers_sharing_a_gpu_get_the_same_pool_whichever_loads_first():
    """Two servers of a 16 GB model on an 80 GB GPU, each with half of it: the pool is 0.9 of the half
    less the server's own weights, in either order; sized from free memory the first took 2.5x the
    second's pool. Another process's memory still bounds it (the free memory's fraction)."""
    from kvcache.group import gpu_pool_bytes

    gb, weights = 1 << 30, 16 << 30
    share = KvCacheConfig(gpu_memory_share=0.5)
    first, _ = gpu_pool_bytes(share, free=80 * gb - weights, total=80 * gb, held=weights)
    second, _ = gpu_pool_bytes(share, free=80 * gb - 2 * weights - first, total=80 * gb, held=weights)
    assert first == second == int(0.9 * 40 * gb) - weights
    free_based = KvCacheConfig(free_gpu_memory_fraction=0.45)
    a, _ = gpu_pool_bytes(free_based, free=80 * gb - weights, total=80 * gb, held=weights)
    b, _ = gpu_pool_bytes(free_based, free=80 * gb - 2 * weights - a, total=80 * gb, held=weights)
    assert a > 2.5 * b
    crowded, basis = gpu_pool_bytes(share, free=10 * gb, total=80 * gb, held=weights)
    assert crowded == int(0.9 * 10 * gb) and "gpu_memory_share=0.5" in basis
    assert gpu_pool_bytes(share, free=60 * gb, total=80 * gb, held=40 * gb)[0] == 0  # too big to share


def test_one_kv_format_value_names_the_slot_the_hash_namespace_and_the_id():
    heads, latent = KVFormat(torch.float16, 2, 8), KVFormat(torch.float16, 1, 48, layout="latent")
    assert (heads.planes, heads.slot_shape(3, 4), heads.bytes_per_token(3)) == (2, (3, 2, 4, 2, 8), 3 * 2 * 2 * 8 * 2)
    assert (latent.planes, latent.slot_shape(3, 4), latent.bytes_per_token(3)) == (1, (3, 1, 4, 1, 48), 3 * 48 * 2)
    assert (heads.id, latent.id) == ("heads:float16:2x8", "latent:float16:1x48")
    assert (heads.hash_namespace, latent.hash_namespace) == ("", "latent:float16")  # K/V heads: today's hashes
    fp8 = KVFormat(torch.float8_e4m3fn, 1, 48, layout="latent", k_scales=(0.5, 0.25))
    assert fp8.layer_scales(1) == (0.25, 1.0) and fp8.block_scales((0, 1)) == (0.5, 0.25)
    assert fp8.id.startswith("latent:float8_e4m3fn:1x48:") and fp8.hash_namespace.startswith("latent:float8_e4m3fn:")
    with pytest.raises(ValueError, match="a latent cache has one head, not 2"):
        KVFormat(torch.float16, 2, 48, layout="latent")
    with pytest.raises(ValueError, match="no v_scales"):
        KVFormat(torch.float8_e4m3fn, 1, 48, layout="latent", k_scales=(1.0,), v_scales=(1.0,))
    layout = CacheLayout((64, 64), latent, "cpu", 64)
    manager = KVCacheManager(KvCacheConfig(tokens_per_block=4, max_tokens=16), layout, salt="m")
    assert manager.salt == "m\x1ekv=latent:float16" and manager.layer_latent(1).shape == (4, 4, 48)
    with pytest.raises(KVCacheError, match="no K and V planes"):
        manager.layer_cache(0)
