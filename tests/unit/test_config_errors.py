"""server/config/schema.py: every error is a ConfigError naming the file and the key path."""

import re
from pathlib import Path

import pytest
import yaml

from server.config.schema import ConfigError, load_deployment, load_server_config

pytestmark = pytest.mark.usefixtures("no_env_overrides")


def base() -> dict:
    return {
        "model": "builtin:tiny-llama",
        "context_servers": {"num_instances": 1, "urls": ["127.0.0.1:8001"]},
        "generation_servers": {"num_instances": 1, "urls": ["127.0.0.1:8002"]},
    }


def error_of(tmp_path: Path, data: dict) -> str:
    path = tmp_path / "d.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as info:
        load_deployment(path)
    assert isinstance(info.value, ValueError)
    return str(info.value)


def with_(path: str, value) -> dict:
    """base() with the dotted key `path` set to value."""
    data = base()
    *parents, leaf = path.split(".")
    node = data
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value
    return data


CASES = [
    ("context_servers.kv_cache_config.tokens_per_block", 0,
     "context_servers.kv_cache_config.tokens_per_block: must be >= 1, got 0"),
    ("kv_cache_config.tokens_per_block", -1, "kv_cache_config.tokens_per_block: must be >= 1, got -1"),
    ("generation_servers.kv_cache_config.enable_block_reuse", "yes",
     "generation_servers.kv_cache_config.enable_block_reuse: must be true or false, got a string 'yes'"),
    ("context_servers.kv_cache_config.host_cache_sise", 1,
     "context_servers.kv_cache_config.host_cache_sise: unknown key (did you mean 'host_cache_size'?)"),
    ("context_servers.num_instances", 2,
     "context_servers.num_instances: must equal the number of urls (1), got 2"),
    ("context_servers.urls", ["127.0.0.1"], "context_servers.urls[0]: must be host:port"),
    ("context_servers.urls", ["http://h:80/x"], "context_servers.urls[0]: must be host:port"),
    ("context_servers.urls", [], "context_servers.urls: must be a non-empty list"),
    ("generation_servers.urls", ["127.0.0.1:70000"],
     "generation_servers.urls[0]: must be a port in 1..65535, got 70000"),
    ("generation_servers.urls", ["localhost:8001"], "duplicate port 8001: context server 127.0.0.1:8001 and "
     "generation server localhost:8001"),
    ("port", 8001, "duplicate port 8001: router (hostname:port) and context server 127.0.0.1:8001"),
    ("port", 0, "port: must be >= 1, got 0"),
    ("port", "8000", "port: must be an integer, got a string '8000'"),
    ("router.type", "random",
     "router.type: must be one of round_robin, load_balancing, kv_cache_aware, got 'random'"),
    ("router.typo", "x", "router.typo: unknown key (did you mean 'type'?); valid keys: type"),
    ("router.kind", "x", "router.kind: unknown key; valid keys: type"),
    ("max_num_tokens", 0, "max_num_tokens: must be >= 1, got 0"),
    ("context_servers.env", {"BAD-NAME": "1"}, "context_servers.env: 'BAD-NAME' is not an environment variable name"),
    ("generation_servers.env", {"CUDA_VISIBLE_DEVICES": [1]}, "generation_servers.env.CUDA_VISIBLE_DEVICES: must be a "
     "string or a number, got list"),
    ("env", {"PDSERVE_AUTH_TOKEN": "x" * 32}, "env.PDSERVE_AUTH_TOKEN: the launcher sets it"),
    ("env", ["A=1"], "env: must be a mapping"),
    ("context_servers.max_batch_size", -4, "context_servers.max_batch_size: must be >= 1, got -4"),
    ("max_seq_len", True, "max_seq_len: must be an integer, got a boolean True"),
    ("dtype", "fp8", "dtype: must be one of auto, float32, bfloat16, float16, got 'fp8'"),
    ("generation_servers.device", "tpu",
     "generation_servers.device: must be one of auto, cpu, cuda, got 'tpu'"),
    ("max_seq_length", 10, "max_seq_length: unknown key (did you mean 'max_seq_len'?)"),
    ("context_servers.kv_cache", {},
     "context_servers.kv_cache: unknown key (did you mean 'kv_cache_config'?)"),
    ("cache_transceiver_config.kv_transfer_timeout", 5,
     "cache_transceiver_config.kv_transfer_timeout: unknown key (did you mean 'kv_transfer_timeout_ms'?)"),
    ("cache_transceiver_config.kv_transfer_timeout_ms", 0,
     "cache_transceiver_config.kv_transfer_timeout_ms:"),
    ("context_servers.cache_transceiver_config.port", -1, "context_servers.cache_transceiver_config.port:"),
    ("context_servers.cache_transceiver_config.port", 8002,
     "duplicate port 8002: the transceiver of context server 127.0.0.1:8001 and generation server"),
    ("context_servers.cache_transceiver_config.auth_token", "a" * 20,
     "context_servers.cache_transceiver_config.auth_token: one token serves the whole deployment"),
    ("cache_transceiver_config.auth_token", 123,
     "cache_transceiver_config.auth_token: must be null or a string of at least 16 characters, got an "
     "integer 123"),
    ("generation_servers.model", "other", "model: every server must serve the same model"),
    ("kv_cache_config", [1], "kv_cache_config: must be a mapping, got a list"),
    ("hostname", "", "hostname: must be a non-empty string, got ''"),
    ("engine_process", "yes", "engine_process: must be auto, true or false, got 'yes'"),
    ("generation_servers.engine_process", 1,
     "generation_servers.engine_process: must be auto, true or false, got an integer 1"),
    ("speculative.method", "medusa", "speculative.method: must be one of off, ngram, draft_model, got 'medusa'"),
    ("generation_servers.speculative.num_speculative_tokens", 0,
     "generation_servers.speculative.num_speculative_tokens: must be >= 1, got 0"),
    ("speculative.ngram_maximum", 3, "speculative.ngram_maximum: unknown key (did you mean 'ngram_max'?)"),
    ("speculative.ngram_min", 5, "speculative.ngram_min: 5 is above ngram_max (3)"),
    ("speculative.method", "draft_model", "speculative.draft_model: required when method is draft_model"),
    ("context_servers.gpu_share", 0,
     "context_servers.gpu_share: must be auto, off or a percent of the GPU's SMs (1..100), got 0"),
    ("gpu_share", 60, "gpu_share: an SM cap below 100 is refused: under CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=60 an "
     "H100 computed NaN logits (docs/GPU.md); use auto (CUDA MPS without a cap), 100 or off"),
    ("gpu_share", 101, "gpu_share: must be auto, off or a percent of the GPU's SMs (1..100), got 101"),
    ("generation_servers.gpu_share", "mps",
     "generation_servers.gpu_share: must be auto, off or a percent of the GPU's SMs (1..100), got 'mps'"),
    ("gpu_share", True, "gpu_share: must be auto, off or a percent of the GPU's SMs (1..100), got 'on'"),
    ("gpu_share", 50.5, "gpu_share: must be auto, off or a percent of the GPU's SMs (1..100), got a number 50.5"),
    ("context_servers.env", {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": 60},
     "context_servers.env.CUDA_MPS_ACTIVE_THREAD_PERCENTAGE: set by gpu_share (give the share as gpu_share: "
     "<percent>); set gpu_share: off to run CUDA MPS yourself"),
    ("env", {"CUDA_MPS_PIPE_DIRECTORY": "/tmp/mps"},
     "env.CUDA_MPS_PIPE_DIRECTORY: set by gpu_share (the launcher's daemon sets it); set gpu_share: off to run "
     "CUDA MPS yourself"),
]


@pytest.mark.parametrize(("key", "value", "expected"), CASES, ids=[c[0] + "=" + repr(c[1]) for c in CASES])
def test_bad_value_names_file_and_key(tmp_path, key, value, expected):
    message = error_of(tmp_path, with_(key, value))
    assert message.startswith(f"{tmp_path / 'd.yaml'}: {expected}"), message


def test_missing_model(tmp_path):
    data = base()
    del data["model"]
    assert error_of(tmp_path, data).endswith("d.yaml: model: required (builtin:tiny-llama or a Hugging Face "
                                             "model directory)")


def test_merge_problem_is_reported_in_the_section(tmp_path):
    data = with_("kv_cache_config.tokens_per_block", 64)
    data["context_servers"]["kv_cache_config"] = {"max_tokens": 32}
    message = error_of(tmp_path, data)
    assert message.endswith("d.yaml: context_servers.kv_cache_config.max_tokens: 32 is below one block "
                            "(tokens_per_block=64)")


def test_context_without_generation(tmp_path):
    data = base()
    del data["generation_servers"]
    message = error_of(tmp_path, data)
    assert message.endswith("d.yaml: generation_servers: required when context_servers is given")


def test_wildcard_host_collides_with_loopback(tmp_path):
    data = with_("generation_servers.urls", ["0.0.0.0:8001"])
    assert "duplicate port 8001" in error_of(tmp_path, data)


def test_same_port_on_different_hosts_is_allowed(tmp_path):
    path = tmp_path / "d.yaml"
    path.write_text(yaml.safe_dump(with_("generation_servers.urls", ["10.0.0.2:8001"])))
    assert [s.port for s in load_deployment(path).servers] == [8001, 8001]


@pytest.mark.parametrize(("text", "expected"), [
    ("model: [unclosed\n", r"d\.yaml: invalid YAML: .* at line \d+, column \d+$"),
    ("model: a\nmodel: b\n", r"d\.yaml: invalid YAML: duplicate key 'model' at line 2, column 1$"),
    ("- a\n- b\n", r"d\.yaml: must be a YAML mapping of keys, got a list$"),
    ("", r"d\.yaml: must be a YAML mapping of keys, got null$"),
])
def test_yaml_level_errors(tmp_path, text, expected):
    path = tmp_path / "d.yaml"
    path.write_text(text)
    for loader in (load_deployment, load_server_config):
        with pytest.raises(ConfigError, match=expected):
            loader(path)


def test_missing_file(tmp_path):
    path = tmp_path / "absent.yaml"
    with pytest.raises(ConfigError, match=re.escape(f"{path}: cannot read: No such file or directory")):
        load_deployment(path)


def test_server_config_unknown_key_lists_valid_keys(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("model: m\nportt: 8001\n")
    with pytest.raises(ConfigError) as info:
        load_server_config(path)
    assert str(info.value) == (f"{path}: portt: unknown key (did you mean 'port'?); valid keys: model, "
                               "max_seq_len, max_batch_size, max_num_tokens, max_prefill_batch_tokens, dtype, device, "
                               "kernels, cuda_graphs, quantization, tensor_parallel_size, expert_parallel_size, "
                               "expert_dispatch, engine_process, async_scheduling, kv_cache_config, speculative, "
                               "cache_transceiver_config, kv_stream, drain_timeout_s, "
                               "max_n, env, gpu_share, hostname, port, context_urls")


def test_a_gpu_share_error_in_a_file_of_one_server_names_it(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("model: m\ngpu_share: 0\n")
    with pytest.raises(ConfigError) as info:
        load_server_config(path)
    assert str(info.value) == f"{path}: gpu_share: must be auto, off or a percent of the GPU's SMs (1..100), got 0"
