"""server/config/schema.py: loading, inheritance, defaults, and the shipped configs."""

import re
from pathlib import Path

import pytest
import torch
from config_files import write
from msgspec.structs import replace

from kvcache import KvCacheConfig
from server.config.schema import (
    AUTH_TOKEN_ENV,
    HOSTNAME_ENV,
    ConfigError,
    inherit,
    load_deployment,
    load_server,
    load_server_config,
    server_config_from_dict,
    with_auth_token,
)
from transceiver.config import TransceiverConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TOKEN = "0123456789abcdef0123"


pytestmark = pytest.mark.usefixtures("no_env_overrides")


def disagg(**extra) -> dict:
    return {
        "model": "builtin:tiny-llama",
        "context_servers": {"num_instances": 1, "urls": ["127.0.0.1:8001"]},
        "generation_servers": {"num_instances": 1, "urls": ["127.0.0.1:8002"]},
        **extra,
    }


def test_disagg_defaults_and_roles(tmp_path):
    cfg = load_deployment(write(tmp_path, disagg()))
    assert (cfg.host, cfg.port, cfg.router.type, cfg.has_router) == ("127.0.0.1", 8000, "round_robin", True)
    assert cfg.url == "http://127.0.0.1:8000"
    assert cfg.disaggregated and cfg.model == "builtin:tiny-llama"
    assert [(s.role, s.host, s.port) for s in cfg.servers] == [
        ("context", "127.0.0.1", 8001), ("generation", "127.0.0.1", 8002)]
    ctx = cfg.context_servers[0]
    assert (ctx.max_seq_len, ctx.max_batch_size, ctx.max_num_tokens, ctx.dtype, ctx.device) == (
        2048, 64, 2048, "auto", "auto")
    assert ctx.kv_cache_config == KvCacheConfig(gpu_memory_share=0.5)  # half the GPU each
    assert ctx.cache_transceiver_config == TransceiverConfig(auth_token=None)
    assert cfg.auth_token is None
    assert cfg.generation_servers[0].url == "http://127.0.0.1:8002"


def test_sections_inherit_and_override_top_level(tmp_path):
    data = disagg(max_seq_len=4096, dtype="float32",
                  kv_cache_config={"tokens_per_block": 16, "max_tokens": 512},
                  cache_transceiver_config={"kv_transfer_timeout_ms": 5000, "auth_token": TOKEN})
    data["context_servers"].update(max_seq_len=1024,
                                   kv_cache_config={"max_tokens": 1024, "host_cache_size": 4096},
                                   cache_transceiver_config={"port": 9100})
    cfg = load_deployment(write(tmp_path, data))
    ctx, gen = cfg.context_servers[0], cfg.generation_servers[0]
    assert (ctx.max_seq_len, gen.max_seq_len, ctx.dtype, gen.dtype) == (1024, 4096, "float32", "float32")
    assert ctx.kv_cache_config == KvCacheConfig(tokens_per_block=16, max_tokens=1024, host_cache_size=4096)
    assert gen.kv_cache_config == KvCacheConfig(tokens_per_block=16, max_tokens=512)
    assert ctx.cache_transceiver_config == TransceiverConfig(kv_transfer_timeout_ms=5000, port=9100, auth_token=TOKEN)
    assert gen.cache_transceiver_config == TransceiverConfig(kv_transfer_timeout_ms=5000, auth_token=TOKEN)
    assert cfg.auth_token == TOKEN


def test_a_disk_tier_directory_serves_one_server_of_a_host(tmp_path):
    disk = {"host_cache_size": 1 << 20, "disk": {"path": "/var/cache/kv", "max_bytes": 1 << 30}}
    with pytest.raises(ConfigError, match=r"x\.yaml: kv_cache_config\.disk\.path: context server 127\.0\.0\.1:8001 "
                                          r"and generation server 127\.0\.0\.1:8002 both use '/var/cache/kv'"):
        load_deployment(write(tmp_path, disagg(kv_cache_config=disk)))
    data = disagg(kv_cache_config=disk)
    data["generation_servers"]["kv_cache_config"] = {"disk": {"path": "/var/cache/kv-gen", "max_bytes": 1 << 30}}
    cfg = load_deployment(write(tmp_path, data))
    assert [s.kv_cache_config.disk.path for s in cfg.servers] == ["/var/cache/kv", "/var/cache/kv-gen"]


def test_only_generation_servers_run_aggregated_behind_the_router(tmp_path):
    data = disagg()
    del data["context_servers"]
    cfg = load_deployment(write(tmp_path, data))
    assert not cfg.disaggregated and cfg.has_router
    assert [(s.role, s.port) for s in cfg.servers] == [("aggregated", 8002)]
    assert cfg.aggregated_servers == cfg.servers


def test_no_server_section_is_one_aggregated_server_without_router(tmp_path):
    cfg = load_deployment(write(tmp_path, {"model": "m", "hostname": "localhost", "port": 9000,
                                           "max_batch_size": 8}))
    assert not cfg.has_router
    assert [(s.role, s.host, s.port, s.max_batch_size) for s in cfg.servers] == [
        ("aggregated", "localhost", 9000, 8)]


def test_hostname_env_overrides_router_host_only(tmp_path, monkeypatch):
    monkeypatch.setenv(HOSTNAME_ENV, "0.0.0.0")
    cfg = load_deployment(write(tmp_path, disagg()))
    assert cfg.host == "0.0.0.0"
    assert {s.host for s in cfg.servers} == {"127.0.0.1"}


def test_auth_token_env_fills_a_null_token(tmp_path, monkeypatch):
    monkeypatch.setenv(AUTH_TOKEN_ENV, TOKEN)
    cfg = load_deployment(write(tmp_path, disagg()))
    assert cfg.auth_token == TOKEN
    assert [s.cache_transceiver_config.auth_token for s in cfg.servers] == [TOKEN, TOKEN]
    path = write(tmp_path, {"model": "m"}, "server.yaml")
    assert load_server_config(path, "context").cache_transceiver_config == TransceiverConfig(auth_token=TOKEN)


def test_with_auth_token_sets_every_server(tmp_path):
    cfg = with_auth_token(load_deployment(write(tmp_path, disagg())), TOKEN)
    assert cfg.auth_token == TOKEN
    assert [s.cache_transceiver_config.auth_token for s in cfg.servers] == [TOKEN, TOKEN]


def test_inheritance_is_one_function_and_sections_win():
    top = {"model": "m", "max_seq_len": 64, "port": 9000, "router": {},
           "kv_cache_config": {"tokens_per_block": 16, "max_tokens": 512}}
    section = {"urls": ["h:1"], "max_seq_len": 32, "kv_cache_config": {"max_tokens": 1024}}
    assert inherit(top, section) == {"model": "m", "max_seq_len": 32,
                                     "kv_cache_config": {"tokens_per_block": 16, "max_tokens": 1024}}


def test_each_child_reads_its_own_server_from_the_deployment_file(tmp_path, monkeypatch):
    data = disagg(cache_transceiver_config={"kv_transfer_timeout_ms": 7000})
    data["context_servers"]["kv_cache_config"] = {"max_tokens": 1024, "host_cache_size": 1 << 20,
                                                  "secondary_offload_min_priority": 0}
    path = write(tmp_path, data)
    monkeypatch.setenv(AUTH_TOKEN_ENV, TOKEN)  # as the launcher hands it to its children
    cfg = load_deployment(path)
    assert list(cfg.named()) == ["context-0", "generation-0"]
    ctx, gen = load_server(path, "context-0"), load_server(path, "generation-0")
    assert (ctx, gen) == cfg.servers
    assert ctx.cache_transceiver_config == TransceiverConfig(kv_transfer_timeout_ms=7000, auth_token=TOKEN)
    assert ctx.kv_cache_config == KvCacheConfig(max_tokens=1024, host_cache_size=1 << 20,
                                                secondary_offload_min_priority=0)
    assert gen.context_urls == ("127.0.0.1:8001",) and gen.role == "generation"
    with pytest.raises(ConfigError, match=r"x\.yaml: no server 'context-1'; the deployment has context-0, "
                                          r"generation-0$"):
        load_server(path, "context-1")


def test_server_config_from_dict_for_the_command_line():
    cfg = server_config_from_dict({"model": "/models/x", "port": 8100}, "command line")
    assert (cfg.role, cfg.model, cfg.host, cfg.port, cfg.max_num_tokens) == (
        "aggregated", "/models/x", "127.0.0.1", 8100, 2048)
    with pytest.raises(ConfigError, match=r"^command line: port: must be <= 65535, got 70000$"):
        server_config_from_dict({"model": "m", "port": 70000}, "command line")


def test_server_config_refuses_deployment_keys(tmp_path):
    path = write(tmp_path, disagg())
    with pytest.raises(ConfigError, match=r"x\.yaml: context_servers: not allowed in a server config"):
        load_server_config(path)


REQUIRED = {"aggregated", "disagg", "disagg_2x2", "disagg_host_offload", "disagg_vswa"}


def test_required_configs_are_shipped():
    assert REQUIRED <= {p.stem for p in CONFIGS.glob("*.yaml")}


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    cfg = load_deployment(path)
    assert (cfg.host, cfg.port, cfg.auth_token) == ("127.0.0.1", 8000, None)
    if cfg.has_router:
        assert [s.port for s in cfg.servers] == list(range(8001, 8001 + len(cfg.servers)))


def test_shipped_config_shapes():
    assert [s.role for s in load_deployment(CONFIGS / "disagg.yaml").servers] == ["context", "generation"]
    two = load_deployment(CONFIGS / "disagg_2x2.yaml")
    assert two.router.type == "kv_cache_aware"
    assert [s.port for s in two.context_servers] == [8001, 8002]
    assert [s.port for s in two.generation_servers] == [8003, 8004]
    assert load_deployment(CONFIGS / "disagg_vswa.yaml").model == "builtin:tiny-qwen3-swa"
    offload = load_deployment(CONFIGS / "disagg_host_offload.yaml")
    ctx_kv = offload.context_servers[0].kv_cache_config
    assert (ctx_kv.tokens_per_block, ctx_kv.max_tokens, ctx_kv.host_cache_size) == (32, 1024, 256 << 20)
    assert ctx_kv.secondary_offload_min_priority == 0
    assert ctx_kv.enable_block_reuse and ctx_kv.enable_partial_reuse
    gen_kv = offload.generation_servers[0].kv_cache_config
    assert (gen_kv.host_cache_size, gen_kv.enable_block_reuse) == (0, True)
    agg = load_deployment(CONFIGS / "aggregated.yaml")
    assert not agg.has_router and agg.servers[0].role == "aggregated"
    assert load_server_config(CONFIGS / "aggregated.yaml") == agg.servers[0]


def test_max_prefill_batch_tokens_unset_inherits_and_survives_the_child_yaml(tmp_path):
    data = disagg(max_prefill_batch_tokens=512)
    data["context_servers"]["max_prefill_batch_tokens"] = 128
    cfg = load_deployment(write(tmp_path, data))
    ctx, gen = cfg.context_servers[0], cfg.generation_servers[0]
    assert (ctx.max_prefill_batch_tokens, gen.max_prefill_batch_tokens) == (128, 512)
    assert load_deployment(write(tmp_path, disagg(), "d.yaml")).context_servers[0].max_prefill_batch_tokens is None
    assert load_server(write(tmp_path, data), "context-0").max_prefill_batch_tokens == 128
    with pytest.raises(ConfigError, match=r"bad.yaml: context_servers.max_prefill_batch_tokens: must be >= 1, got 0"):
        data["context_servers"]["max_prefill_batch_tokens"] = 0
        load_deployment(write(tmp_path, data, "bad.yaml"))
    with pytest.raises(ConfigError, match=r"max_prefill_batch_tokens: must be an integer or null, got a string 'all'"):
        load_deployment(write(tmp_path, disagg(max_prefill_batch_tokens="all"), "bad2.yaml"))


def test_scheduler_limits_default_the_prefill_batch_by_device():
    from server.engine_host.build import CPU_PREFILL_BATCH_TOKENS, scheduler_limits

    cfg = server_config_from_dict({"model": "builtin:tiny-llama", "max_num_tokens": 1024})
    cpu, cuda = scheduler_limits(cfg, torch.device("cpu")), scheduler_limits(cfg, torch.device("cuda"))
    assert (cpu.max_num_tokens, cpu.max_prefill_batch_tokens) == (1024, CPU_PREFILL_BATCH_TOKENS)
    assert cuda.max_prefill_batch_tokens is None  # a GPU batches prompts up to max_num_tokens
    chosen = replace(cfg, max_prefill_batch_tokens=64)
    assert scheduler_limits(chosen, torch.device("cpu")).max_prefill_batch_tokens == 64


def test_async_scheduling_is_auto_true_or_false_and_auto_means_cuda(tmp_path):
    from server.engine_host.build import use_async_scheduling

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    cfg = server_config_from_dict({"model": "builtin:tiny-llama"})
    assert cfg.async_scheduling == "auto"
    assert (use_async_scheduling(cfg, cpu), use_async_scheduling(cfg, cuda)) == (False, True)
    for value in (True, False):
        chosen = load_server_config(write(tmp_path, {"model": "m", "async_scheduling": value}, f"{value}.yaml"))
        assert use_async_scheduling(chosen, cpu) is use_async_scheduling(chosen, cuda) is value
    with pytest.raises(ConfigError, match=r"bad.yaml: async_scheduling: must be one of auto, true, false, got 'on'"):
        load_server_config(write(tmp_path, {"model": "m", "async_scheduling": "on"}, "bad.yaml"))


def shares(cfg) -> list:
    return [(s.kv_cache_config.gpu_memory_share, s.kv_cache_config.free_gpu_memory_fraction) for s in cfg.servers]


def test_servers_that_may_share_the_gpu_split_its_memory(tmp_path):
    assert shares(load_deployment(write(tmp_path, disagg(), "d.yaml"))) == [(0.5, None), (0.5, None)]
    chosen = disagg(kv_cache_config={"free_gpu_memory_fraction": 0.3})
    assert shares(load_deployment(write(tmp_path, chosen))) == [(None, 0.3)] * 2  # the file's own sizing
    given = disagg(kv_cache_config={"gpu_memory_share": 0.7})
    assert shares(load_deployment(write(tmp_path, given))) == [(0.7, None)] * 2
    data = disagg()
    data["context_servers"]["device"] = "cpu"  # the generation server is the GPU's only user
    assert shares(load_deployment(write(tmp_path, data))) == [(None, None)] * 2
    fixed = disagg(kv_cache_config={"max_tokens": 4096})
    assert shares(load_deployment(write(tmp_path, fixed))) == [(None, None)] * 2
    assert load_server(tmp_path / "d.yaml", "context-0").kv_cache_config.gpu_memory_share == 0.5


def test_a_null_section_takes_its_defaults_and_a_null_override_keeps_the_top_level(tmp_path):
    data = disagg(kv_cache_config={"tokens_per_block": 16}, router=None, restart=None)
    data["context_servers"]["kv_cache_config"] = None
    data["generation_servers"]["cache_transceiver_config"] = None
    cfg = load_deployment(write(tmp_path, data))
    assert [s.kv_cache_config.tokens_per_block for s in cfg.servers] == [16, 16]
    assert cfg.router.type == "round_robin" and cfg.restart.max_quick_deaths == 5
    path = write(tmp_path, {"model": "m", "kv_cache_config": None}, "server.yaml")
    assert load_server_config(path).kv_cache_config == KvCacheConfig()


@pytest.mark.parametrize(("argv", "expected"), [
    (["--server", "context-9"], r"x\.yaml: no server 'context-9'; the deployment has context-0, generation-0"),
    (["--server", "context-0", "--role", "context"], "nor --server with --role"),
    (["--port", "9000"], "cannot be combined"),
])
def test_serve_command_line_names_a_server_of_the_deployment(tmp_path, capsys, argv, expected):
    from server.cli import main

    path = write(tmp_path, disagg())
    assert main(["serve", "--config", str(path), *argv]) == 2
    assert re.search(expected, capsys.readouterr().err)
    assert main(["serve", "--server", "context-0"]) == 2
    assert "--server needs --config DEPLOYMENT.yaml" in capsys.readouterr().err


def test_gpu_share_is_inherited_and_sections_override_it(tmp_path):
    cfg = load_deployment(write(tmp_path, disagg()))
    assert [s.gpu_share for s in cfg.servers] == ["auto", "auto"]
    data = disagg(gpu_share="off")
    data["context_servers"]["gpu_share"] = 100
    assert [s.gpu_share for s in load_deployment(write(tmp_path, data)).servers] == [100, "off"]


def test_yaml_on_and_off_are_words_for_gpu_share_and_kv_stream(tmp_path):
    """YAML 1.1 reads a bare `off` as false: these keys take it as the word."""
    path = tmp_path / "d.yaml"
    path.write_text("model: builtin:tiny-llama\ngpu_share: off\nkv_stream: off\n"
                    "context_servers:\n  urls: ['127.0.0.1:8001']\n  kv_stream: on\n"
                    "generation_servers:\n  urls: ['127.0.0.1:8002']\n  gpu_share: 100\n")
    cfg = load_deployment(path)
    assert [(s.role, s.gpu_share, s.kv_stream) for s in cfg.servers] == [
        ("context", "off", "on"), ("generation", 100, "off")]
    assert load_server(path, "context-0") == cfg.servers[0]


def test_mps_variables_in_env_only_with_gpu_share_off(tmp_path):
    mps = {"CUDA_MPS_PIPE_DIRECTORY": "/tmp/mps-pipe", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": 60}
    data = disagg(gpu_share="off", env=mps)
    cfg = load_deployment(write(tmp_path, data))
    assert [s.env for s in cfg.servers] == [{"CUDA_MPS_PIPE_DIRECTORY": "/tmp/mps-pipe",
                                             "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "60"}] * 2
    data["generation_servers"]["gpu_share"] = "auto"
    with pytest.raises(ConfigError, match=r"x\.yaml: env\.CUDA_MPS_ACTIVE_THREAD_PERCENTAGE: set by gpu_share \(give "
                                          r"the share as gpu_share: <percent>\)"):
        load_deployment(write(tmp_path, data))
