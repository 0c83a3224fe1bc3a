"""The ports a pdserve process listens on: bound before anything is started or loaded, so that a port
in use is an error at start-up that names it, never a server that answers for another deployment."""

from __future__ import annotations

import random
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from server.config.schema import DeploymentConfig, host_port

PORT_HINT = "Stop what listens there (`ss -ltnp` shows it) or choose another port."


@dataclass(frozen=True)
class Listener:
    """A port one process of a deployment listens on, and the key of the file that sets it."""

    name: str  # "router", "context-0", ...
    key: str  # "port", "context_servers.urls[0]", "cache_transceiver_config.port of context-0"
    host: str
    port: int


def bind_http(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (SO_REUSEADDR, as uvicorn binds), not yet listening; OSError if
    the port is in use or the address is not this machine's."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def bind_or_say(host: str, port: int, command: str, what: str) -> socket.socket | None:
    """`bind_http`, or None once stderr says `pdserve COMMAND: cannot listen on HOST:PORT WHAT: why`."""
    try:
        return bind_http(host, port)
    except OSError as exc:
        print(f"pdserve {command}: cannot listen on {host_port(host, port)} {what}: {exc.strerror or exc}; "
              f"nothing was started. {PORT_HINT}", file=sys.stderr, flush=True)
        return None


def listeners(cfg: DeploymentConfig) -> list[Listener]:
    """Every fixed port of a deployment: the router's, each server's HTTP port, and each context
    server's transceiver port where the file sets one (0, the default, is an ephemeral port)."""
    found = [Listener("router", "port", cfg.host, cfg.port)] if cfg.has_router else []
    for name, server in cfg.named().items():
        index = int(name.rsplit("-", 1)[1])
        section = "context_servers" if server.role == "context" else "generation_servers"
        key = f"{section}.urls[{index}]" if cfg.has_router else "port"
        found.append(Listener(name, key, server.host, server.port))
        kv = server.cache_transceiver_config
        if server.role == "context" and kv.port:
            for rank in range(server.tensor_parallel_size):  # rank r listens on port + r
                found.append(Listener(name, f"cache_transceiver_config.port of {name}", kv.host, kv.port + rank))
    return found


def busy_ports(cfg: DeploymentConfig) -> list[str]:
    """One line per port of the deployment that cannot be listened on now, naming its server and key."""
    lines = []
    for item in listeners(cfg):
        try:
            bind_http(item.host, item.port).close()
        except OSError as exc:  # the OS's words
            lines.append(f"port {item.port} of {item.name} ({item.key} in {cfg.source}: "
                         f"{host_port(item.host, item.port)}): {exc.strerror or exc}")
    return lines


_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_SPAN = 16_000  # ports below the ephemeral range to draw from
_LOWEST = 10_000


def ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (32768 where /proc does not say)."""
    try:
        return int(_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Nothing bound to host:port (TIME_WAIT leftovers count as taken: a server may not get it)."""
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def quiet_ports(count: int, lane: int = 0, lanes: int = 1, avoid: set[int] | None = None,
                host: str = "127.0.0.1") -> list[int]:
    """`count` distinct ports free on `host`, drawn at random from below the kernel's ephemeral range
    (where OS-chosen ports of KV sockets and client connections come from, so none of those can take
    one before its server binds it); `lane` of `lanes` splits the range between parallel callers."""
    top = ephemeral_start()
    bottom = max(_LOWEST, top - _SPAN) if top > _LOWEST + 1000 else 1024
    width = max(1, (top - bottom) // max(1, lanes))
    start = bottom + (lane % max(1, lanes)) * width
    taken = set(avoid or ())
    out: list[int] = []
    for port in random.sample(range(start, start + width), width):
        if port not in taken and is_free(port, host):
            out.append(port)
            taken.add(port)
            if len(out) == count:
                return out
    raise RuntimeError(f"no {count} free ports on {host} in {start}-{start + width - 1}")
