"""The deployment keys: restart policy, router.migration_limit, drain_timeout_s."""

from __future__ import annotations

import pytest
import yaml

from server.config.schema import ConfigError, RestartPolicy, load_deployment


def deployment(tmp_path, **extra):
    data = {"model": "builtin:tiny-llama",
            "context_servers": {"num_instances": 1, "urls": ["127.0.0.1:8001"]},
            "generation_servers": {"num_instances": 1, "urls": ["127.0.0.1:8002"]}, **extra}
    path = tmp_path / "d.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_defaults(tmp_path):
    cfg = load_deployment(deployment(tmp_path))
    assert cfg.restart == RestartPolicy(max_quick_deaths=5, backoff_s=1.0, quick_s=60.0)
    assert cfg.router.migration_limit == 1 and cfg.drain_timeout_s == 30.0
    assert all(s.drain_timeout_s == 30.0 for s in cfg.servers)


def test_values_and_section_override(tmp_path):
    cfg = load_deployment(deployment(
        tmp_path, restart={"max_quick_deaths": 0, "backoff_s": 0.5, "quick_s": 10}, drain_timeout_s=12,
        router={"type": "round_robin", "migration_limit": 3},
        generation_servers={"num_instances": 1, "urls": ["127.0.0.1:8002"], "drain_timeout_s": 90}))
    assert cfg.restart == RestartPolicy(0, 0.5, 10.0)
    assert cfg.router.migration_limit == 3 and cfg.drain_timeout_s == 12.0
    assert [s.drain_timeout_s for s in cfg.servers] == [12.0, 90.0]


@pytest.mark.parametrize("extra, message", [
    ({"restart": {"max_quick_death": 1}}, "restart.max_quick_death: unknown key (did you mean 'max_quick_deaths'?); "
                                         "valid keys: max_quick_deaths, backoff_s, quick_s"),
    ({"restart": {"backoff_s": -1}}, "restart.backoff_s: must be >= 0, got -1"),
    ({"restart": {"quick_s": "soon"}}, "restart.quick_s: must be a number, got a string 'soon'"),
    ({"router": {"migration_limit": -1}}, "router.migration_limit: must be >= 0, got -1"),
    ({"drain_timeout_s": True}, "drain_timeout_s: must be a number, got a boolean True"),
])
def test_errors_name_the_key_and_file(tmp_path, extra, message):
    path = deployment(tmp_path, **extra)
    with pytest.raises(ConfigError) as info:
        load_deployment(path)
    assert str(info.value) == f"{path}: {message}"
