"""A deployment's actors on Ray, by name: `pdserve ray status NAME`, `pdserve ray down NAME`, and the
launcher's own stop. Stop order as on one host: the router drains first, then every server at once
(each actor SIGTERMs its process and waits for its drain), then every actor and placement group of
the deployment is removed."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import suppress
from typing import Any

from server.config.schema import ROUTER
from server.deploy.ray import NAMESPACE, require_ray
from server.deploy.supervisor import health

CALL_TIMEOUT_S = 30.0
ASK_TIMEOUT_S = 5.0  # a question to an actor that may be restarting (its calls wait until it is back)
DEFAULT_STOP_WAIT_S = 45.0  # an actor that does not say how long its drain may take
STOP_MARGIN_S = 15.0  # beyond an actor's own stop wait (drain + grace), for the call itself


class Handles:
    """The actors of one deployment by server name (`context-0/rank1` for a rank's bundle)."""

    def __init__(self, ray, deployment: str) -> None:
        self.ray, self.deployment = ray, deployment
        self.actors: dict[str, Any] = {}
        self.health_urls: dict[str, str] = {}
        self.first_pid: dict[str, int] = {}
        self.gone: set[str] = set()
        self.groups: list[str] = []  # placement groups placed, by server name (an actor may be missing)
        self.stop_waits: dict[str, float] = {}  # each process's drain + grace, where the launcher knows it

    def add(self, name: str, actor: Any, health_url: str | None = None) -> None:
        self.actors[name] = actor
        if health_url is not None:
            self.health_urls[name] = health_url

    def processes(self) -> list[str]:
        """The actors that run a process (servers and the router), not the ranks' bundles."""
        return [n for n in self.actors if "/" not in n]

    def dead(self, name: str) -> bool:
        """True when the actor died and Ray will not restart it (remembered in `gone`)."""
        exceptions = self.ray.exceptions
        try:
            self.ray.get(self.actors[name].info.remote(), timeout=2.0)
        except (exceptions.ActorUnavailableError, exceptions.GetTimeoutError):  # restarting, or no answer yet
            return False
        except exceptions.RayActorError:
            self.gone.add(name)
            return True
        return False


def actor_names(ray, deployment: str) -> list[str]:
    return [n for n in ray.util.list_named_actors() if n.startswith(f"{deployment}/")]


def stop_deployment(handles: Handles, say: Callable[[str], None]) -> None:
    """Drain the router, then the servers; remove every actor and placement group."""
    ray, processes = handles.ray, handles.processes()
    for stage in ([n for n in processes if n == ROUTER], [n for n in processes if n != ROUTER]):
        calls = {name: handles.actors[name].stop.remote() for name in stage}
        deadline = time.monotonic() + max((handles_wait(handles, name) for name in stage), default=0.0)
        for name, ref in calls.items():
            try:
                how = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
                say(f"stopped {name} ({how})")
            except Exception as exc:  # gone, restarting or stuck: killed below all the same
                say(f"{name} did not stop by itself ({type(exc).__name__}): killing its actor")
    for actor in handles.actors.values():
        with suppress(Exception):  # already dead
            ray.kill(actor, no_restart=True)
    _remove_groups(ray, handles.deployment, sorted({*handles.groups, *processes}))
    handles.actors.clear()


def handles_wait(handles: Handles, name: str) -> float:
    """How long to wait for `name`'s stop call: its drain and grace, then a margin."""
    if name not in handles.stop_waits:
        try:
            info = handles.ray.get(handles.actors[name].info.remote(), timeout=ASK_TIMEOUT_S)
            handles.stop_waits[name] = info["stop_wait_s"]
        except Exception:  # restarting, or gone: it cannot say
            handles.stop_waits[name] = DEFAULT_STOP_WAIT_S
    return handles.stop_waits[name] + STOP_MARGIN_S


def _remove_groups(ray, deployment: str, names: list[str]) -> None:
    from ray.util.placement_group import get_placement_group, remove_placement_group

    for name in names:
        with suppress(Exception):  # none of that name (never placed, or removed already)
            remove_placement_group(get_placement_group(f"{deployment}/{name}"))


def connect(address: str, namespace: str):
    ray = require_ray()
    ray.init(address=address, namespace=namespace, logging_level=logging.WARNING, log_to_driver=False)
    return ray


def _found(command: str, deployment: str, address: str, namespace: str) -> Handles | None:
    ray = connect(address, namespace)
    handles = Handles(ray, deployment)  # its actors as the cluster names them
    for name in sorted(actor_names(ray, deployment)):
        handles.add(name.removeprefix(f"{deployment}/"), ray.get_actor(name))
    if handles.actors:
        return handles
    print(f"pdserve ray {command}: no deployment {deployment!r} in namespace {namespace}")
    return None


def down(deployment: str, address: str = "auto", namespace: str = NAMESPACE) -> int:
    """`pdserve ray down NAME`: 0 once stopped, 1 if no such deployment runs."""
    if (handles := _found("down", deployment, address, namespace)) is None:
        return 1
    stop_deployment(handles, lambda line: print(f"[pdserve ray down] {line}", flush=True))
    return 0


def status(deployment: str, address: str = "auto", namespace: str = NAMESPACE) -> int:
    """`pdserve ray status NAME`: a line per server (node, GPUs, epoch, health); 1 if none runs."""
    if (handles := _found("status", deployment, address, namespace)) is None:
        return 1
    print(f"{'NAME':<16} {'NODE':<28} {'GPU':<8} {'PID':>8} {'RESTARTED':<10} {'EPOCH':<34} HEALTH")
    for name in handles.processes():
        print(_status_line(handles.ray, name, handles.actors[name]), flush=True)
    return 0


def _status_line(ray, name: str, actor: Any) -> str:
    try:
        info = ray.get(actor.info.remote(), timeout=CALL_TIMEOUT_S)
    except Exception as exc:  # dead, or restarting
        return f"{name:<16} {'-':<28} {'-':<8} {'-':>8} {'-':<10} {'-':<34} actor unavailable ({type(exc).__name__})"
    code, body = health(info["health_url"], 5.0)
    node = f"{info['node_ip']}/{info['node_id'][:12]}"
    gpus = ",".join(info["gpus"]) or "-"
    state = f"{code} {body.get('status', '')}".strip() if code else "unreachable"
    return (f"{name:<16} {node:<28} {gpus:<8} {info['pid']:>8} {'yes' if info['restarted'] else 'no':<10} "
            f"{body.get('epoch', '-'):<34} {state}")
