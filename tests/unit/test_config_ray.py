"""`ray_actor_options` in the deployment YAML, the placement plan built from it (server/deploy/ray/
placement.py, without a cluster), and the machine name the same-GPU decision compares."""

from pathlib import Path

import pytest
import yaml

from server.config.schema import ConfigError, RayActorOptions, deployment_from_dict, load_deployment
from server.deploy.ports import quiet_ports
from server.deploy.ray.placement import (
    provisional,
    unplaced_sections,
    wants,
    with_urls,
    without_token,
)
from transceiver.wire import NODE_ID_ENV, PeerIdentity, node_name

pytestmark = pytest.mark.usefixtures("no_env_overrides")


def base(**top) -> dict:
    return {"model": "builtin:tiny-llama", **top,
            "context_servers": {"num_instances": 1, "urls": ["127.0.0.1:8001"]},
            "generation_servers": {"num_instances": 2, "urls": ["127.0.0.1:8002", "127.0.0.1:8003"]}}


def load(tmp_path: Path, data: dict):
    path = tmp_path / "d.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_deployment(path)


def error_of(tmp_path: Path, data: dict) -> str:
    with pytest.raises(ConfigError) as info:
        load(tmp_path, data)
    return str(info.value).split(": ", 1)[1]  # without the file name


def test_sections_place_their_servers_and_the_top_level_places_the_router(tmp_path):
    data = base(ray_actor_options={"resources": {"head": 1}, "num_cpus": 0.5})
    env = {"env_vars": {"A": "1"}}
    data["context_servers"]["ray_actor_options"] = {"num_gpus": 1, "num_cpus": 4, "runtime_env": env}
    cfg = load(tmp_path, data)
    assert cfg.ray_actor_options == {
        "context-0": RayActorOptions(num_cpus=4, num_gpus=1, runtime_env={"env_vars": {"A": "1"}}),
        "generation-0": RayActorOptions(), "generation-1": RayActorOptions(),  # not inherited from the top level
        "router": RayActorOptions(num_cpus=0.5, resources={"head": 1})}
    assert cfg.ray_actor_options["context-0"].bundle() == {"CPU": 4, "GPU": 1}
    assert cfg.ray_actor_options["router"].bundle() == {"CPU": 0.5, "head": 1}


def test_a_single_server_deployment_takes_the_top_level_options(tmp_path):
    cfg = load(tmp_path, {"model": "builtin:tiny-llama", "ray_actor_options": {"num_gpus": 1}})
    assert cfg.ray_actor_options == {"aggregated-0": RayActorOptions(num_gpus=1)}


@pytest.mark.parametrize(("options", "expected"), [
    ({"num_gpu": 1}, "context_servers.ray_actor_options.num_gpu: unknown key (did you mean 'num_gpus'?); "
                     "valid keys: num_cpus, num_gpus, resources, runtime_env"),
    ({"num_cpus": -1}, "context_servers.ray_actor_options.num_cpus: must be >= 0, got -1"),
    ({"resources": {"GPU": 1}}, "context_servers.ray_actor_options.resources.GPU: give it as num_gpus"),
    ({"resources": {"node_a": "one"}},
     "context_servers.ray_actor_options.resources.node_a: must be a number >= 0, got 'one'"),
    ({"num_cpus": 0}, "context_servers.ray_actor_options.num_cpus: an actor must ask for some resource "
                      "(num_cpus, num_gpus or resources)"),
    ({"runtime_env": ["pip"]}, "context_servers.ray_actor_options.runtime_env: must be a mapping, got a list"),
])
def test_bad_options_name_the_key(tmp_path, options, expected):
    data = base()
    data["context_servers"]["ray_actor_options"] = options
    assert error_of(tmp_path, data).startswith(expected)


def test_urls_may_be_left_out_only_for_ray(tmp_path):
    data = base()
    del data["generation_servers"]["urls"]
    assert error_of(tmp_path, data) == (
        "generation_servers.urls: required (a non-empty list of host:port strings); "
        "only `pdserve launch --ray` places servers without urls (num_instances of them)")
    del data["generation_servers"]["num_instances"]
    assert error_of(tmp_path, data).startswith("generation_servers.urls: required")


def test_the_ray_plan_checks_the_file_with_provisional_addresses_then_takes_the_placed_ones(tmp_path):
    data = base(cache_transceiver_config={"auth_token": "t" * 32})
    data["context_servers"]["tensor_parallel_size"] = 2
    del data["generation_servers"]["urls"]
    assert unplaced_sections(data) == ["generation_servers"]
    checked = deployment_from_dict(provisional(data), "d.yaml", tmp_path)
    assert [(w.name, w.ranks, w.key) for w in wants(checked)] == [
        ("context-0", 2, "context_servers.ray_actor_options"),
        ("generation-0", 1, "generation_servers.ray_actor_options"),
        ("generation-1", 1, "generation_servers.ray_actor_options"), ("router", 1, "ray_actor_options")]
    placed = with_urls(data, {"generation_servers": ["10.1.0.2:41000", "10.1.0.3:41001"]})
    cfg = deployment_from_dict(placed, "d.yaml", tmp_path)
    assert [s.url for s in cfg.generation_servers] == ["http://10.1.0.2:41000", "http://10.1.0.3:41001"]
    assert cfg.generation_servers[0].context_urls == ("127.0.0.1:8001",)
    assert cfg.auth_token == "t" * 32
    assert "auth_token" not in without_token(placed)["cache_transceiver_config"]  # the nodes' copy
    assert data["cache_transceiver_config"]["auth_token"] == "t" * 32 and "urls" not in data["generation_servers"]


def test_ports_picked_together_are_distinct():
    ports = quiet_ports(8, host="127.0.0.1")  # what each node's probe runs (free_ports)
    assert len(set(ports)) == 8 and all(1024 <= p <= 65535 for p in ports)


def test_under_ray_the_machine_is_the_ray_node(monkeypatch):
    monkeypatch.delenv(NODE_ID_ENV, raising=False)
    import socket

    assert node_name() == socket.gethostname()
    monkeypatch.setenv(NODE_ID_ENV, "abc123")
    assert node_name() == "ray:abc123"
    # two Ray nodes on one host (one hostname, one boot, a GPU id seen alike): not the same GPU
    a = PeerIdentity(hostname="ray:node-a", boot_id="b", gpu_uuid="GPU-1", pid=1)
    assert not a.shares_gpu_with(PeerIdentity(hostname="ray:node-b", boot_id="b", gpu_uuid="GPU-1", pid=2))
    assert a.shares_gpu_with(PeerIdentity(hostname="ray:node-a", boot_id="b", gpu_uuid="GPU-1", pid=2))
