"""Where each actor of a deployment runs: a STRICT_PACK placement group of one bundle per rank,
named like its actor (`<deployment>/<server>`) so that `pdserve ray down` finds it again."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Any

from server.config.schema import ROUTER, DeploymentConfig, RayActorOptions
from server.deploy.ports import quiet_ports

SECTIONS = {"context": "context_servers", "generation": "generation_servers", "aggregated": "generation_servers"}
STRATEGY = "STRICT_PACK"  # a tensor-parallel server's ranks on one node


class PlacementError(RuntimeError):
    """The cluster cannot place the deployment (no such node, or not within the wait)."""


@dataclass(frozen=True)
class Want:
    """What one server (or the router) asks of the cluster."""

    name: str  # context-0, generation-1, router
    options: RayActorOptions
    ranks: int  # bundles: one per tensor-parallel rank
    key: str  # where the file set it: `context_servers.ray_actor_options`, or `ray_actor_options`

    @property
    def total(self) -> dict[str, float]:
        return {k: v * self.ranks for k, v in self.options.bundle().items()}


@dataclass(frozen=True)
class Placed:
    want: Want
    group: Any  # ray.util.placement_group.PlacementGroup
    node_id: str
    node_ip: str


def wants(cfg: DeploymentConfig) -> list[Want]:
    """The servers in file order, then the router."""
    out = []
    for name, server in cfg.named().items():
        key = f"{SECTIONS[server.role]}.ray_actor_options" if cfg.has_router else "ray_actor_options"
        out.append(Want(name, cfg.ray_actor_options[name], server.tensor_parallel_size, key))
    if cfg.has_router:
        out.append(Want(ROUTER, cfg.ray_actor_options[ROUTER], 1, "ray_actor_options"))
    return out


def check_feasible(ray, wanted: list[Want], source: str) -> None:
    """Refuse at once what no alive node could ever hold (a busy cluster is waited for instead)."""
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    for want in wanted:
        if not any(_fits(want.total, n["Resources"]) for n in nodes):
            have = "; ".join(f"{n['NodeManagerAddress']} {_plain(n['Resources'])}" for n in nodes) or "none"
            ranks = f" ({want.ranks} ranks of {_plain(want.options.bundle())})" if want.ranks > 1 else ""
            raise PlacementError(f"{source}: {want.key}: {want.name} needs {_plain(want.total)} on one node{ranks}; "
                                 f"no node of the cluster has that (nodes: {have})")


def place(ray, wanted: list[Want], deployment: str, detached: bool, timeout_s: float) -> dict[str, Placed]:
    """A ready placement group per want; PlacementError (all removed) if one is not ready in `timeout_s`."""
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

    lifetime = "detached" if detached else None
    groups = {w.name: placement_group([w.options.bundle()] * w.ranks, strategy=STRATEGY,
                                      name=f"{deployment}/{w.name}", lifetime=lifetime) for w in wanted}
    deadline = time.monotonic() + timeout_s
    pending = [w for w in wanted if not groups[w.name].wait(max(0.0, deadline - time.monotonic()))]
    if pending:
        for group in groups.values():
            remove_placement_group(group)
        raise PlacementError(f"not placed within {timeout_s:g} s (the cluster's free resources do not hold them): "
                             + "; ".join(f"{w.name} ({w.key}: {_plain(w.total)})" for w in pending))
    ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}
    out = {}
    for w in wanted:
        node = placement_group_table(groups[w.name])["bundles_to_node_id"][0]
        out[w.name] = Placed(w, groups[w.name], node, ips.get(node, "?"))
    return out


def strategy(placed: Placed, bundle: int = 0):
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(placed.group, placement_group_bundle_index=bundle)


def free_ports(ray, placed: dict[str, Placed], names: list[str]) -> dict[str, int]:
    """A free port for each of `names` on its node, below its ephemeral range (no OS-chosen port of a
    KV socket or client connection can take one before its server binds it). Nodes of one address
    (several Ray nodes of one machine) get theirs from one probe, so no port is handed out twice there."""
    by_ip: dict[str, list[str]] = {}
    for name in names:
        by_ip.setdefault(placed[name].node_ip, []).append(name)
    probe = ray.remote(num_cpus=0)(quiet_ports)
    calls = {ip: probe.options(scheduling_strategy=strategy(placed[group[0]])).remote(len(group), host=ip)
             for ip, group in by_ip.items()}
    out = {}
    for ip, group in by_ip.items():
        out.update(zip(group, ray.get(calls[ip], timeout=60), strict=True))
    return out


def with_urls(data: dict[str, Any], urls: dict[str, list[str]]) -> dict[str, Any]:
    """The file's mapping with these sections' `urls` set."""
    out = copy.deepcopy(data)
    for section, section_urls in urls.items():
        out[section]["urls"] = section_urls
        out[section].pop("num_instances", None)
    return out


def without_token(data: dict[str, Any]) -> dict[str, Any]:
    """The mapping the actors' nodes write to disk: the token reaches them in the environment only."""
    out = copy.deepcopy(data)
    ctc = out.get("cache_transceiver_config")
    if isinstance(ctc, dict):
        ctc.pop("auth_token", None)
    return out


PROVISIONAL_PORT = 30000  # only for checking the file before placement: never listened on


def provisional(data: dict[str, Any]) -> dict[str, Any]:
    """The file with a distinct loopback address for every server its sections leave without urls,
    so that the one loader checks everything else before anything is placed."""
    urls, port = {}, PROVISIONAL_PORT
    for section in unplaced_sections(data):
        if isinstance(data[section].get("num_instances"), int):
            count = max(1, data[section]["num_instances"])
            urls[section] = [f"127.0.0.1:{port + i}" for i in range(count)]
            port += count
    return with_urls(data, urls) if urls else data


def unplaced_sections(data: dict[str, Any]) -> list[str]:
    """The sections whose servers the file gives no urls (their addresses come from placement)."""
    return [s for s in ("context_servers", "generation_servers")
            if isinstance(data.get(s), dict) and data[s].get("urls") is None]


def _fits(need: dict[str, float], have: dict[str, float]) -> bool:
    return all(have.get(k, 0.0) >= v for k, v in need.items())


def _plain(resources: dict[str, float]) -> str:
    shown = {k: (int(v) if float(v).is_integer() else v) for k, v in sorted(resources.items())
             if not k.startswith(("node:", "memory", "object_store_memory", "accelerator_type:"))}
    return "{" + ", ".join(f"{k}: {v}" for k, v in shown.items()) + "}"
