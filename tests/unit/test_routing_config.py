"""router: keys of docs/ROUTING.md: read from the deployment YAML with their defaults, and errors that
name the file and the key."""

from pathlib import Path

import pytest
import yaml

from server.config.router import SHARED_GPU_LOCAL_PREFILL, Conditional, KvWeights, QueueLimits
from server.config.schema import AUTH_TOKEN_ENV, ConfigError, load_deployment


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv(AUTH_TOKEN_ENV, raising=False)


def _load(tmp_path: Path, router: dict, disaggregated: bool = True):
    data = {"model": "builtin:tiny-llama", "router": router,
            "generation_servers": {"num_instances": 1, "urls": ["127.0.0.1:8002"]}}
    if disaggregated:
        data["context_servers"] = {"num_instances": 1, "urls": ["127.0.0.1:8001"]}
    path = tmp_path / "d.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_deployment(path)


def test_defaults_and_every_key(tmp_path):
    router = _load(tmp_path, {"type": "kv_cache_aware"}).router
    assert (router.kv_weights, router.load_weight, router.queue, router.conditional) == (
        KvWeights(1.0, 0.75, 0.25), 1.0, QueueLimits(64, 1024, 60.0), None)
    cfg = _load(tmp_path, {"type": "kv_cache_aware", "kv_weights": {"primary": 2, "secondary": 0.5},
                           "load_weight": 0.25, "queue": {"max_inflight_per_server": 0, "max_waiting": 8,
                                                          "timeout_s": 1.5},
                           "conditional": {"max_local_prefill_length": 128, "min_prefix_hit": 256}})
    router = cfg.router
    assert (router.kv_weights, router.load_weight, router.queue, router.conditional) == (
        KvWeights(2.0, 0.5, 0.25), 0.25, QueueLimits(0, 8, 1.5), Conditional(128, 256))
    assert router.conditional.enabled and not Conditional().enabled
    assert cfg.router_config(shared_gpu=True).conditional == Conditional(128, 256)
    disk = _load(tmp_path, {"type": "kv_cache_aware", "kv_weights": {"disk": 0.1}}).router
    assert (disk.kv_weights, disk.load_weight) == (KvWeights(1.0, 0.75, 0.1), 1.0)


@pytest.mark.parametrize(("router", "expected"), [
    ({"kv_weights": {"host": 0.5}}, "router.kv_weights.host: unknown key; valid keys: primary, secondary, disk"),
    ({"kv_weights": {"secondary": -1}}, "router.kv_weights.secondary: must be >= 0, got -1"),
    ({"load_weight": "high"}, "router.load_weight: must be a number, got a string 'high'"),
    ({"load_weight": float("nan")}, "router.load_weight: must be >= 0, got nan"),
    ({"queue": {"max_inflight_per_server": -1}}, "router.queue.max_inflight_per_server: must be >= 0, got -1"),
    ({"queue": {"timeout": 5}}, "router.queue.timeout: unknown key (did you mean 'timeout_s'?)"),
    ({"queue": {"timeout_s": True}}, "router.queue.timeout_s: must be a number, got a boolean True"),
    ({"conditional": {"min_prefix_hit": 0}}, "router.conditional.min_prefix_hit: must be >= 1, got 0"),
    ({"conditional": {"max_local_prefill": 8}}, "router.conditional.max_local_prefill: unknown key (did you "
                                                "mean 'max_local_prefill_length'?)"),
    ({"kv_weight": {}}, "router.kv_weight: unknown key (did you mean 'kv_weights'?)"),
    ({"auth_token": "x"}, "router.auth_token: unknown key; valid keys: type, migration_limit, "),  # the deployment's
])
def test_errors_name_the_file_and_the_key(tmp_path, router, expected):
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, router)
    assert str(info.value).startswith(f"{tmp_path / 'd.yaml'}: {expected}"), str(info.value)


def test_a_pair_on_one_gpu_serves_short_prefills_locally_unless_the_yaml_says(tmp_path):
    """Left out, `router.conditional` is off, except where the launcher says a context and a generation
    server share a GPU: then prompts of up to SHARED_GPU_LOCAL_PREFILL new tokens skip the context leg.
    `conditional: {}` keeps it off; an aggregated deployment has no context leg to skip."""
    plain = _load(tmp_path, {})
    assert plain.router_config().conditional == Conditional(None, None)
    assert plain.router_config(shared_gpu=True).conditional == Conditional(SHARED_GPU_LOCAL_PREFILL, None)
    assert SHARED_GPU_LOCAL_PREFILL == 256
    assert _load(tmp_path, {"conditional": {}}).router_config(shared_gpu=True).conditional == Conditional(None, None)
    alone = _load(tmp_path, {}, disaggregated=False)
    assert not alone.router_config(shared_gpu=True).conditional.enabled


def test_conditional_needs_context_servers(tmp_path):
    with pytest.raises(ConfigError, match=r"d.yaml: router.conditional: needs context_servers"):
        _load(tmp_path, {"conditional": {"max_local_prefill_length": 64}}, disaggregated=False)
