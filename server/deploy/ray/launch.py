"""`pdserve launch CONFIG.yaml --ray ADDRESS`: place the deployment's actors, wait for them, report
deaths until a stop signal, then stop them all (or leave them running with `--detach`)."""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from server.config.schema import ROUTER, DeploymentConfig, deployment_from_dict
from server.config.yaml_io import read_yaml
from server.deploy.launcher import LaunchOptions, child_env, handshakes_done, health_url, ready_line
from server.deploy.ray import NAMESPACE, require_ray
from server.deploy.ray.actors import ActorSpec, ProcessActor, RankActor
from server.deploy.ray.manage import Handles, actor_names, connect, stop_deployment
from server.deploy.ray.placement import (
    SECTIONS,
    Placed,
    check_feasible,
    free_ports,
    place,
    provisional,
    strategy,
    unplaced_sections,
    wants,
    with_urls,
    without_token,
)
from server.deploy.supervisor import Child, StopOnSignals, health, wait_healthy

POLL_S = 1.0


@dataclass(frozen=True)
class RayOptions:
    address: str = "auto"
    name: str | None = None  # the deployment's name: its actors are <name>/<server>; default the file's stem
    namespace: str = NAMESPACE
    detach: bool = False
    placement_timeout_s: float = 120.0


class Launch:
    """One launch: the deployment's name, its config once placed, and the actors started so far."""

    def __init__(self, ray, name: str, options: LaunchOptions, ray_options: RayOptions) -> None:
        self.ray, self.name, self.options, self.ray_options = ray, name, options, ray_options
        self.handles = Handles(ray, name)
        self.cfg: DeploymentConfig | None = None

    def actor_options(self, placed: Placed, bundle: int, suffix: str = "") -> dict[str, Any]:
        opts = placed.want.options
        return {"name": f"{self.name}/{placed.want.name}{suffix}", "num_cpus": opts.num_cpus,
                "num_gpus": opts.num_gpus, "resources": dict(opts.resources),
                "runtime_env": dict(opts.runtime_env) or None, "scheduling_strategy": strategy(placed, bundle),
                "lifetime": "detached" if self.ray_options.detach else None}


def launch_on_ray(path: str | Path, options: LaunchOptions, ray_options: RayOptions) -> int:
    """Run the deployment in `path` on the Ray cluster at `ray_options.address` (returns as `launch`)."""
    require_ray()  # before the file: without Ray, nothing else is said
    data = read_yaml(path)
    base = Path(path).resolve().parent
    checked = deployment_from_dict(provisional(data), str(path), base)  # every key checked before placing
    name = ray_options.name or Path(path).stem
    ray = connect(ray_options.address, ray_options.namespace)
    # Ray warns that removing a detached actor's placement group kills it: `pdserve ray down` means that
    logging.getLogger("ray.actor").setLevel(logging.ERROR)
    if actor_names(ray, name):
        say(f"a deployment {name!r} runs on this cluster already (namespace {ray_options.namespace}): "
            f"`pdserve ray down {name}` first, or give another --name")
        return 1
    wanted = wants(checked)
    check_feasible(ray, wanted, str(path))
    run = Launch(ray, name, options, ray_options)
    detached = False
    with StopOnSignals() as stop:
        try:
            placed = place(ray, wanted, name, ray_options.detach, ray_options.placement_timeout_s)
            run.handles.groups = list(placed)
            run.cfg, text = _placed_config(ray, data, checked, placed, base)
            code = _start(run, placed, text, stop)
            if code is not None:
                return code
            if ray_options.detach:
                detached = True
                say(f"detached: `pdserve ray status {name}` shows it, `pdserve ray down {name}` stops it")
                return 0
            return _supervise(run, stop)
        finally:
            if not detached:
                stop_deployment(run.handles, say)


def _placed_config(ray, data: dict, checked: DeploymentConfig, placed: dict[str, Placed],
                   base: Path) -> tuple[DeploymentConfig, str]:
    """The deployment with every server's address (the file's, or its node's and a free port there)
    and the file the actors read (the same without the token)."""
    names = {section: [n for n, s in checked.named().items() if SECTIONS[s.role] == section]
             for section in unplaced_sections(data)}
    ports = free_ports(ray, placed, [n for group in names.values() for n in group])
    urls = {section: [f"{placed[n].node_ip}:{ports[n]}" for n in group] for section, group in names.items()}
    full = with_urls(data, urls)
    cfg = deployment_from_dict(full, checked.source, base)
    for name, p in placed.items():
        bundles = f" ({p.want.ranks} bundles, {p.want.options.bundle()} each)" if p.want.ranks > 1 else ""
        say(f"placed {name} on node {p.node_ip} ({p.node_id[:12]}){bundles}")
    return cfg, yaml.safe_dump(without_token(full), sort_keys=False)


def _start(run: Launch, placed: dict[str, Placed], text: str, stop: StopOnSignals) -> int | None:
    """Start the servers, wait for them and their handshakes, then the router; None once all serve."""
    cfg = run.cfg
    token = cfg.auth_token or secrets.token_hex(32)
    rank_gpus = _hold_ranks(run, [placed[name] for name in cfg.named()])
    servers = [_start_actor(run, placed[name], server.role, server.host, server.port, text, token, server.env,
                            rank_gpus[name], server.drain_timeout_s) for name, server in cfg.named().items()]
    if not _started(run, servers):
        return 1
    if not _healthy(run, servers, stop) or not handshakes_done(stop, servers, say):
        return 0 if stop.signum is not None else 1
    if cfg.has_router:
        router = _start_actor(run, placed[ROUTER], ROUTER, cfg.host, cfg.port, text, token, {}, (), cfg.drain_timeout_s)
        if not _started(run, [router]) or not _healthy(run, [router], stop):
            return 0 if stop.signum is not None else 1
    front = placed[ROUTER if cfg.has_router else next(iter(cfg.named()))]  # the router, or the only server
    url = health_url(cfg.host, cfg.port, front.node_ip).removesuffix("/health")
    say(f"{ready_line(cfg, url)} as Ray actors {run.name}/* in namespace {run.ray_options.namespace}")
    return None


def _hold_ranks(run: Launch, servers: list[Placed]) -> dict[str, tuple[str, ...]]:
    """Ranks 1..N-1 of each tensor-parallel server hold their bundles (the server's process runs
    them); the GPUs Ray gave them, by server."""
    ray, holders = run.ray, {}
    for placed in servers:
        name = placed.want.name
        for rank in range(1, placed.want.ranks):
            holder = ray.remote(RankActor).options(**run.actor_options(placed, rank, f"/rank{rank}")).remote()
            run.handles.add(f"{name}/rank{rank}", holder)
            holders.setdefault(name, []).append(holder.info.remote())
    found = {name: ray.get(refs, timeout=run.ray_options.placement_timeout_s) for name, refs in holders.items()}
    return {p.want.name: tuple(g for info in found.get(p.want.name, []) for g in info["gpus"]) for p in servers}


def _start_actor(run: Launch, placed: Placed, role: str, host: str, port: int, text: str, token: str,
                 env: dict[str, str], rank_gpus: tuple[str, ...], drain_s: float) -> Child:
    """The actor that runs a server or the router, in `run.handles` (not waited for: `_started`)."""
    cfg, name = run.cfg, placed.want.name
    threads = str(max(1, int(placed.want.options.num_cpus)))  # the actor's CPUs, as Ray sets OMP_NUM_THREADS
    env = {**child_env({}, token, len(cfg.servers)), "OMP_NUM_THREADS": threads, **env}
    child = Child(name, role, Path(name), health_url(host, port, placed.node_ip), env)
    spec = ActorSpec(run.name, child, text, placed.node_id, rank_gpus,
                     str(run.options.log_dir) if run.options.log_dir else None, cfg.restart.backoff_s,
                     stop_wait_s=drain_s + run.options.grace_s)
    restarts = 0 if cfg.restart.max_quick_deaths == 0 else -1
    actor = run.ray.remote(ProcessActor).options(max_restarts=restarts, max_task_retries=0,
                                                 **run.actor_options(placed, 0)).remote(spec)
    run.handles.add(child.name, actor, child.health_url)
    run.handles.stop_waits[child.name] = spec.stop_wait_s
    return child


def _started(run: Launch, started: list[Child]) -> bool:
    """Wait until every actor has started its process (all at once), and say where each runs; False
    when one could not (its runtime_env failed to set up, its constructor raised, the wait ran out)."""
    try:
        infos = run.ray.get([run.handles.actors[c.name].info.remote() for c in started],
                            timeout=run.ray_options.placement_timeout_s)
    except Exception as exc:  # RayActorError, RuntimeEnvSetupError, GetTimeoutError
        say(f"an actor of {', '.join(c.name for c in started)} did not start: {type(exc).__name__}: {exc}")
        return False
    for child, info in zip(started, infos, strict=True):
        gpus = f", GPU {','.join(info['gpus'])}" if info["gpus"] else ""
        say(f"started {run.name}/{child.name} on {info['node_ip']} (pid {info['pid']}{gpus})  > {info['log']}")
        if info["niceness"] > 0:
            say(f"warning: {child.name} runs at niceness {info['niceness']} (Ray's for its workers; lowering it "
                "needs CAP_SYS_NICE): start the Ray nodes with RAY_worker_niceness=0 to serve at normal priority")
        run.handles.first_pid[child.name] = info["pid"]
    return True


def _healthy(run: Launch, started: list[Child], stop: StopOnSignals) -> bool:
    return wait_healthy(started, lambda c: _exit_of(run, c), lambda c: _tail(run, c), stop,
                        run.options.startup_timeout_s, run.options.poll_interval_s, say)


def _exit_of(run: Launch, child: Child) -> str | None:
    """How a starting server ended: its process exited, or Ray restarted or lost its actor."""
    try:
        info = run.ray.get(run.handles.actors[child.name].info.remote(), timeout=30)
    except Exception as exc:  # RayActorError, GetTimeoutError: the actor is gone or stuck
        return f"its actor unavailable ({type(exc).__name__})"
    if info["exited"] is not None:
        return info["exited"]
    return "a restart by Ray (its process died)" if info["pid"] != run.handles.first_pid[child.name] else None


def _tail(run: Launch, child: Child) -> str:
    try:
        return run.ray.get(run.handles.actors[child.name].tail.remote(), timeout=30)
    except Exception as exc:  # the log stays on its node
        return f" (no log: {type(exc).__name__})"


def _supervise(run: Launch, stop: StopOnSignals) -> int:
    """Report deaths and returns (Ray restarts the actors) until a stop signal (0), or until the
    router, or every server, is gone for good (1)."""
    epochs: dict[str, str | None] = {}
    down: dict[str, float] = {}
    while stop.signum is None:
        for name in run.handles.processes():
            _check(run, name, epochs, down)
        gone = run.handles.gone
        if ROUTER in gone or (gone and len(gone) >= len(run.cfg.servers)):
            say("the deployment cannot serve any more: stopping")
            return 1
        time.sleep(POLL_S)
    say("stop signal: stopping")
    return 0


def _check(run: Launch, name: str, epochs: dict[str, str | None], down: dict[str, float]) -> None:
    url = run.handles.health_urls[name]
    status, body = health(url, POLL_S)
    if status == 200:
        epoch = body.get("epoch")
        if name in down:
            say(f"{name} is back: healthy {time.monotonic() - down.pop(name):.1f} s after it went down"
                f"{'; restarted by Ray, epoch ' + str(epoch) if epoch != epochs.get(name) else ''}")
        epochs[name] = epoch
    elif name not in down and name not in run.handles.gone:
        down[name] = time.monotonic()
        why = f"{status} {body.get('status', '')}".strip() if status else "unreachable"
        say(f"{name} is not healthy (health: {why}); Ray restarts its actor if its process died")
    if name in down and run.handles.dead(name):
        say(f"{name} is gone for good (its actor died and is not restarted: its node was lost, or restarts are off)")
        down.pop(name)


def say(message: str) -> None:
    print(f"[pdserve launch --ray] {message}", flush=True)
