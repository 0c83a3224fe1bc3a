"""Rules that span a deployment's servers (one model with one quantization, no shared port, the GPU's
memory shared out, one KV format across the pair), and host:port strings."""

from __future__ import annotations

from typing import Any, Protocol, TypeVar

from msgspec.structs import replace

from kvcache.kv_scales import read_scales
from server.config.yaml_io import ConfigError


class ServerLike(Protocol):
    """What these rules read of a `schema.ServerConfig` (declared here: the schema imports this module)."""

    model: str
    quantization: str | None
    host: str
    port: int
    role: str
    device: str
    kv_cache_config: Any
    cache_transceiver_config: Any
    tensor_parallel_size: int


S = TypeVar("S", bound=ServerLike)

# hosts that bind every interface, so they collide with any host on the same port
_WILDCARD_HOSTS = ("0.0.0.0", "::", "")
_LOOPBACK = ("localhost", "127.0.0.1")


def host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def split_host_port(url: str) -> tuple[str, int]:
    """`host:port` (IPv6 hosts in brackets) -> (host, port)."""
    host, _, port = url.rpartition(":")
    return host.strip("[]"), int(port)


def check_same_model(servers: list[S], source: str) -> None:
    models = {s.model for s in servers}
    if len(models) > 1:
        raise ConfigError(f"{source}: model: every server must serve the same model, got {sorted(models)}")
    quantizations = {str(s.quantization) for s in servers}  # one model's KV, prefixes and tokens: the same weights
    if len(quantizations) > 1:
        raise ConfigError(f"{source}: quantization: every server must serve the same weights, got "
                          f"{sorted(quantizations)} (set it at the top level)")


def check_ports(servers: list[S], router: tuple[str, int] | None, source: str) -> None:
    """No two listeners (router, servers, context transceivers) may share a port on one host."""
    seen: list[tuple[str, int, str]] = [(*router, "router (hostname:port)")] if router else []
    for s in servers:
        seen.append((s.host, s.port, f"{s.role} server {s.host}:{s.port}"))
        ctc_port = s.cache_transceiver_config.port
        if s.role == "context" and ctc_port:  # 0: ephemeral; rank r of a tensor-parallel server: port + r
            for rank in range(s.tensor_parallel_size):
                which = f" (rank {rank})" if s.tensor_parallel_size > 1 else ""
                seen.append((s.host, ctc_port + rank, f"the transceiver of context server {s.host}:{s.port}{which}"))
    for i, (h1, p1, name1) in enumerate(seen):
        for h2, p2, name2 in seen[:i]:
            if p1 == p2 and _same_host(h1, h2):
                raise ConfigError(f"{source}: duplicate port {p1}: {name2} and {name1}")


def check_disk_paths(servers: list[S], source: str) -> None:
    """No two servers on one host may share a disk tier directory (kv_cache_config.disk.path): a
    deployment's sections inherit the top level's kv_cache_config, so give each section its own."""
    seen: list[tuple[str, str, str]] = []
    for s in servers:
        disk = s.kv_cache_config.disk
        if disk is None:
            continue
        name = f"{s.role} server {host_port(s.host, s.port)}"
        for rank in range(s.tensor_parallel_size):  # rank r > 0 of a tensor-parallel server: path.rank<r>
            mine = disk.for_rank(rank).path
            for host, path, other in seen:
                if path == mine and _same_host(host, s.host):
                    raise ConfigError(f"{source}: kv_cache_config.disk.path: {other} and {name} both use "
                                      f"{path!r}; give each server its own directory (set disk.path per section)")
            seen.append((s.host, mine, name if rank == 0 else f"{name} (rank {rank})"))


def check_kv_formats(servers: list[S], source: str) -> None:
    """A context server's KV blocks reach a generation server as they are: both must have the same
    kv_cache_config.dtype and, for FP8, equal scales. Refused here, naming both servers."""
    generation = [s for s in servers if s.role == "generation"]
    for ctx in (s for s in servers if s.role == "context"):
        for gen in generation:
            problem = _kv_format_difference(ctx, gen, source)
            if problem is not None:
                raise ConfigError(f"{source}: kv_cache_config.{problem}")


def _kv_format_difference(ctx: ServerLike, gen: ServerLike, source: str) -> str | None:
    a, b = ctx.kv_cache_config, gen.kv_cache_config
    names = f"context server {host_port(ctx.host, ctx.port)}", f"generation server {host_port(gen.host, gen.port)}"
    if a.dtype != b.dtype:
        return f"dtype differs: {names[0]} has {a.dtype!r}, {names[1]} has {b.dtype!r}"
    if a.dtype != "fp8" or a.scales == b.scales:
        return None
    if a.scales is None or b.scales is None:
        where = [f"{name} {_scales_source(p)}" for name, p in zip(names, (a.scales, b.scales), strict=True)]
        return f"scales differ: {where[0]}, {where[1]}"
    try:
        if read_scales(a.scales) != read_scales(b.scales):
            return f"scales differ: {names[0]} has {a.scales!r}, {names[1]} has {b.scales!r}, of other values"
    except ValueError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    return None


def _scales_source(path: str | None) -> str:
    return "the checkpoint's (or 1.0)" if path is None else repr(path)


def _same_host(a: str, b: str) -> bool:
    if a in _WILDCARD_HOSTS or b in _WILDCARD_HOSTS:
        return True
    return a == b or (a in _LOOPBACK and b in _LOOPBACK)


def share_gpu_memory(servers: list[S]) -> list[S]:
    """The servers of one deployment run on one host and, with device auto or cuda, on its first
    GPU: where a pool would be sized from free memory and nothing says how, each of the n that may use
    the GPU gets 1/n of its total memory (`gpu_memory_share`; else the first to load takes nearly all,
    and the others' pools depend on the order they loaded in)."""
    sharing = sum(s.device != "cpu" for s in servers)
    if sharing < 2:
        return servers
    out = []
    for s in servers:
        kv = s.kv_cache_config
        if s.device != "cpu" and kv.max_tokens is None and kv.free_gpu_memory_fraction is None \
                and kv.gpu_memory_share is None:
            s = replace(s, kv_cache_config=replace(kv, gpu_memory_share=1 / sharing))
        out.append(s)
    return out
