"""`gpu_share`: which servers of a deployment share a GPU, and each one's share of its SMs.

A server sees the GPUs its CUDA_VISIBLE_DEVICES names (its `env`, else the launcher's; all when
unset) and uses the first `tensor_parallel_size`; servers whose GPUs overlap share them. Such a
group runs under CUDA MPS (mps.py) unless one says `gpu_share: off`, when it holds a context and a
generation server (`auto`) or one gives a number. GPUs are compared as written (index or UUID).
This module reads the config only; mps.py checks the host and runs the daemon."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from server.config.schema import ServerConfig

# No server is capped: on an H100 (CUDA 13, torch 2.11; docs/GPU.md, 2026-12-07) a context server
# under CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=60 computed NaN logits for an 8B-shaped bf16 model (torch's
# own kernels too, not only pdserve's Triton ones), while both servers under MPS at 100% gave the
# plain pair's text. So `auto` runs the servers under MPS without a cap, and a number below 100 is
# refused (server/config/schema.py): a server that gives a number gives 100.
SM_PERCENT = 100  # every sharing server's

VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"


@dataclass(frozen=True)
class SharedGpus:
    """Servers that run under MPS together, because their GPUs overlap."""

    gpus: tuple[str, ...]  # as CUDA_VISIBLE_DEVICES names them, in the servers' order
    percent: dict[str, int]  # server name -> its CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, in deployment order
    cuda_required: bool  # a server says `device: cuda` (with only `auto`, a host without GPU runs them on its CPU)
    pair: bool = False  # a context and a generation server among them


@dataclass(frozen=True)
class GpuSharePlan:
    groups: tuple[SharedGpus, ...] = ()

    def percent_of(self, name: str) -> int | None:
        """The server's SM percentage under MPS; None: it does not run under MPS."""
        return next((g.percent[name] for g in self.groups if name in g.percent), None)

    def describe(self) -> str:
        """`context-0 (100%) and generation-0 (100%) on GPU 0`, each group's, joined by `; `."""
        return "; ".join(
            f"{_and([f'{name} ({pct}%)' for name, pct in g.percent.items()])} on GPU {','.join(g.gpus)}"
            for g in self.groups)


def plan_gpu_share(servers: Mapping[str, ServerConfig], launcher_devices: str | None) -> GpuSharePlan:
    """The groups of `servers` (by name, deployment order) that run under MPS. `launcher_devices`
    is the launcher's CUDA_VISIBLE_DEVICES (None: unset)."""
    used = {name: server_gpus(server, launcher_devices) for name, server in servers.items()}
    groups: list[set[str]] = []  # names of servers whose GPUs overlap
    for name, gpus in used.items():
        if gpus:
            touching = [g for g in groups if any(set(used[n]) & set(gpus) for n in g)]
            groups = [g for g in groups if g not in touching] + [{name}.union(*touching)]
    shared = [_shared([n for n in servers if n in g], used, servers) for g in groups if len(g) > 1]
    return GpuSharePlan(tuple(g for g in shared if g is not None))


def server_gpus(server: ServerConfig, launcher_devices: str | None) -> tuple[str, ...]:
    """The GPUs the server's ranks use, as CUDA_VISIBLE_DEVICES names them (indices when unset)."""
    if server.device == "cpu":
        return ()
    visible = server.env.get(VISIBLE_DEVICES, launcher_devices)
    if visible is None:
        return tuple(str(rank) for rank in range(server.tensor_parallel_size))
    return visible_list(visible)[:server.tensor_parallel_size]


def visible_list(value: str) -> tuple[str, ...]:
    """CUDA_VISIBLE_DEVICES as CUDA reads it: entries up to the first empty or negative one."""
    out = []
    for entry in (e.strip() for e in value.split(",")):
        if not entry or entry.startswith("-"):
            break
        out.append(entry)
    return tuple(out)


def _shared(names: list[str], used: dict[str, tuple[str, ...]],
            servers: Mapping[str, ServerConfig]) -> SharedGpus | None:
    members = [servers[n] for n in names]
    shares = [s.gpu_share for s in members]
    roles = {s.role for s in members}
    if "off" in shares or not ({"context", "generation"} <= roles or any(isinstance(s, int) for s in shares)):
        return None
    gpus = tuple(dict.fromkeys(gpu for n in names for gpu in used[n]))
    return SharedGpus(gpus, dict.fromkeys(names, SM_PERCENT), any(s.device == "cuda" for s in members),
                      {"context", "generation"} <= roles)


def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"
