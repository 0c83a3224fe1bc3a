"""`tensor_parallel_size`: per server section, checked against the model's heads at load, errors that
name the key and the file; a context server's fixed KV port is taken by each of its ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from server.config.schema import ConfigError, load_deployment, load_server_config
from server.models.catalog import attention_heads

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _write(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "tp.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _pair(**sections) -> dict:
    return {"model": "builtin:tiny-llama",
            "context_servers": {"urls": ["127.0.0.1:8001"], **sections.get("context", {})},
            "generation_servers": {"urls": ["127.0.0.1:8002"], **sections.get("generation", {})}}


def test_sizes_are_per_section_and_inherited(tmp_path) -> None:
    data = {**_pair(context={"tensor_parallel_size": 4}), "tensor_parallel_size": 2}
    cfg = load_deployment(_write(tmp_path, data))
    assert [s.tensor_parallel_size for s in cfg.servers] == [4, 2]  # tiny-llama: 4 heads, 2 kv heads
    assert load_deployment(_write(tmp_path, _pair())).servers[0].tensor_parallel_size == 1
    moe = {**_pair(generation={"tensor_parallel_size": 2, "expert_parallel_size": 2, "expert_dispatch": "all_to_all"}),
           "model": "builtin:tiny-mixtral"}
    servers = load_deployment(_write(tmp_path, moe)).servers
    assert [(s.expert_parallel_size, s.expert_dispatch) for s in servers] == [(1, "all_reduce"), (2, "all_to_all")]
    tp = load_deployment(CONFIGS / "disagg_tp.yaml")
    assert [(s.role, s.tensor_parallel_size) for s in tp.servers] == [("context", 2), ("generation", 1)]


@pytest.mark.parametrize(("data", "message"), [
    (_pair(generation={"tensor_parallel_size": 3}),
     "generation_servers.tensor_parallel_size: 3 does not divide the model's 4 attention heads"),
    ({**_pair(), "tensor_parallel_size": 8},
     "tensor_parallel_size: 8 does not divide the model's 4 attention heads"),
    ({**_pair(), "model": "builtin:tiny-story", "tensor_parallel_size": 6},
     None),  # 6 heads, 2 kv heads: each kv head on three ranks
    (_pair(context={"tensor_parallel_size": 0}), "context_servers.tensor_parallel_size: must be >= 1, got 0"),
    ({**_pair(generation={"tensor_parallel_size": 2, "expert_parallel_size": 4}), "model": "builtin:tiny-qwen3-moe"},
     "generation_servers.expert_parallel_size: 4: must be 1 or tensor_parallel_size (2)"),
    ({**_pair(generation={"tensor_parallel_size": 2, "expert_dispatch": "all_to_all"}),
      "model": "builtin:tiny-qwen3-moe"},
     "generation_servers.expert_dispatch: all_to_all sends tokens to the ranks that hold their experts: it needs "
     "expert_parallel_size > 1"),
])
def test_sizes_the_model_cannot_take_name_the_key_and_file(tmp_path, data, message) -> None:
    path = _write(tmp_path, data)
    if message is None:
        assert load_deployment(path).servers[0].tensor_parallel_size == 6
        return
    with pytest.raises(ConfigError) as err:
        load_deployment(path)
    assert str(err.value).startswith(f"{path}: {message}"), str(err.value)


def test_a_server_file_is_checked_the_same_way(tmp_path) -> None:
    path = _write(tmp_path, {"model": "builtin:tiny-qwen3-swa", "tensor_parallel_size": 3})
    with pytest.raises(ConfigError, match=r"tp\.yaml: tensor_parallel_size: 3 does not divide"):
        load_server_config(path)


def test_each_context_rank_takes_the_next_kv_port(tmp_path) -> None:
    data = _pair(context={"tensor_parallel_size": 2, "cache_transceiver_config": {"port": 8002}})
    data["generation_servers"]["urls"] = ["127.0.0.1:8004"]
    assert load_deployment(_write(tmp_path, data)).servers[0].cache_transceiver_config.port == 8002
    data["generation_servers"]["urls"] = ["127.0.0.1:8003"]  # rank 1's KV port
    with pytest.raises(ConfigError, match="duplicate port 8003: the transceiver of context server "
                                          r"127.0.0.1:8001 \(rank 1\) and generation server 127.0.0.1:8003"):
        load_deployment(_write(tmp_path, data))


def test_head_counts_are_read_without_loading_the_model(tmp_path) -> None:
    assert attention_heads("builtin:tiny-llama") == (4, 2)
    assert attention_heads("builtin:tiny-story") == (6, 2)
    (tmp_path / "config.json").write_text('{"num_attention_heads": 32, "num_key_value_heads": 8}')
    assert attention_heads(str(tmp_path)) == (32, 8)
    assert attention_heads(str(tmp_path / "absent")) is None  # checked again when the server loads it


def test_a_context_ranks_disk_directory_may_not_be_another_servers(tmp_path) -> None:
    tier = {"max_bytes": 1 << 20}
    data = _pair(context={"tensor_parallel_size": 2, "kv_cache_config": {"host_cache_size": 1 << 20,
                                                                         "disk": {"path": "/kv/ctx", **tier}}},
                 generation={"kv_cache_config": {"host_cache_size": 1 << 20, "disk": {"path": "/kv/gen", **tier}}})
    assert load_deployment(_write(tmp_path, data)).servers[0].kv_cache_config.disk.for_rank(1).path == "/kv/ctx.rank1"
    data["generation_servers"]["kv_cache_config"]["disk"]["path"] = "/kv/ctx.rank1"
    with pytest.raises(ConfigError, match=r"kv_cache_config.disk.path: context server 127.0.0.1:8001 \(rank 1\) "
                                          "and generation server 127.0.0.1:8002 both use '/kv/ctx.rank1'"):
        load_deployment(_write(tmp_path, data))
