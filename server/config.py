"""YAML configuration -> frozen dataclasses, validated on load.

The deployment file has TensorRT-LLM's `trtllm-serve disaggregated` shape: top-level engine keys
(ENGINE_KEYS) are inherited by `context_servers` and `generation_servers`, and a section may override
them; `kv_cache_config` and `cache_transceiver_config` merge key by key (section keys win). Without
`context_servers` the deployment runs aggregated: the `generation_servers` become aggregated servers
behind the router, or, with no server section at all, one aggregated server listens on
`hostname:port` and no router runs.

Every problem raises ConfigError with the message `<file>: <key.path>: <what is wrong>`.
Environment: PDSERVE_HOSTNAME replaces the deployment's top-level `hostname` (the Docker image sets
0.0.0.0 with it); PDSERVE_AUTH_TOKEN supplies `cache_transceiver_config.auth_token` when the file
leaves it null (the launcher hands the token to its children that way, never through argv), or
PDSERVE_AUTH_TOKEN_FILE names a file holding it (an operator restarting one server by hand).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import yaml

from kvcache import KvCacheConfig
from kvcache.config import DEFAULT_GPU_FRACTION
from server.config_yaml import ConfigError, Where, read_yaml
from server.router.auth import ACCESS_KEYS, RouterAccess, router_access_from_yaml
from server.router.routing_config import POLICIES, ROUTING_KEYS, RoutingConfig, routing_from_yaml
from transceiver.config import TransceiverConfig

Role = Literal["aggregated", "context", "generation"]
ROUTER_TYPES = POLICIES  # round_robin, load_balancing, kv_cache_aware, kv_cache_snapshot (docs/ROUTING.md)
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
HOSTNAME_ENV = "PDSERVE_HOSTNAME"
AUTH_TOKEN_ENV = "PDSERVE_AUTH_TOKEN"
AUTH_TOKEN_FILE_ENV = "PDSERVE_AUTH_TOKEN_FILE"  # a file holding the token (operators restarting by hand)
# hosts that bind every interface, so they collide with any host on the same port
_WILDCARD_HOSTS = ("0.0.0.0", "::", "")
ENGINE_KEYS = ("model", "max_seq_len", "max_batch_size", "max_num_tokens", "max_prefill_batch_tokens",
               "dtype", "device", "kernels", "cuda_graphs", "borrow_idle_cores", "kv_cache_config",
               "cache_transceiver_config", "drain_timeout_s")
KERNELS = ("auto", "torch", "triton")
SECTION_KEYS = (*ENGINE_KEYS, "num_instances", "urls")
SERVER_KEYS = (*ENGINE_KEYS, "hostname", "port", "context_urls")  # context_urls: generation servers
DEPLOYMENT_KEYS = (*ENGINE_KEYS, "hostname", "port", "router", "context_servers", "generation_servers", "restart")
ROUTER_KEYS = ("type", "migration_limit")
RESTART_KEYS = ("max_quick_deaths", "backoff_s", "quick_s")
DEFAULT_DRAIN_TIMEOUT_S = 30.0

__all__ = [
    "AUTH_TOKEN_ENV", "AUTH_TOKEN_FILE_ENV", "HOSTNAME_ENV", "ConfigError", "DeploymentConfig", "RestartPolicy",
    "ServerConfig",
    "load_deployment", "load_server_config", "server_config_from_dict", "server_config_to_yaml",
    "with_auth_token", "env_auth_token",
]


@dataclass(frozen=True)
class ServerConfig:
    """One engine process. `cache_transceiver` is the merged `cache_transceiver_config` mapping,
    passed through as given (the transceiver owns its schema); it holds the resolved `auth_token`."""

    role: Role
    model: str
    host: str
    port: int
    max_seq_len: int = 2048
    max_batch_size: int = 64
    max_num_tokens: int = 2048
    # a step starts no more waiting prompts once it prefills this many tokens; None: the device's
    # default (server/serve.py: one prompt's worth on a CPU, max_num_tokens on a GPU)
    max_prefill_batch_tokens: int | None = None
    dtype: str = "auto"
    device: str = "auto"
    # auto: Triton kernels (paged attention, fused norms/RoPE) on CUDA when Triton is installed
    kernels: str = "auto"
    cuda_graphs: bool = True  # with Triton kernels: decode steps replay graphs captured at start-up
    # CPU engines: big steps also use CPUs idle at that moment. Off by default: on VMs whose idle vCPUs
    # wake slowly a two-thread step after an idle spell is slower than a one-thread one (BENCHMARKS.md)
    borrow_idle_cores: bool = False
    kv_cache_config: KvCacheConfig = field(default_factory=KvCacheConfig)
    cache_transceiver: dict[str, Any] = field(default_factory=dict)
    # generation servers: the deployment's context servers ("host:port"); KV is pulled from their
    # KV senders only, never from an address a request names (server/api/context_directory.py)
    context_urls: tuple[str, ...] = ()
    # SIGTERM: refuse new requests, let those in flight and their KV transfers end, at most this long
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@dataclass(frozen=True)
class RestartPolicy:
    """`restart:` of a deployment: how `pdserve launch` brings back a child that died.

    A death within `quick_s` of the child's (re)start is quick; the launcher restarts after
    `backoff_s`, doubled for each quick death in a row (at most 30 s), and gives up on the child
    after `max_quick_deaths` quick deaths in a row. `max_quick_deaths: 0` never restarts."""

    max_quick_deaths: int = 5
    backoff_s: float = 1.0
    quick_s: float = 60.0


@dataclass(frozen=True)
class DeploymentConfig:
    """The whole deployment. `servers` keeps file order: context servers, then generation ones."""

    source: str
    host: str  # router address, or the single aggregated server's when has_router is False
    port: int
    router_type: str
    servers: tuple[ServerConfig, ...]
    has_router: bool
    auth_token: str | None  # None: the launcher makes one per deployment
    router_access: RouterAccess = RouterAccess()  # API keys, open paths, tenant salts (router/auth.py)
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    # router: how many times one request may move to another generation server when its own dies
    migration_limit: int = 1
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S  # the router's (servers have their own)
    routing: RoutingConfig = RoutingConfig()  # scores, queue, conditional disaggregation (router/routing_config.py)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def disaggregated(self) -> bool:
        return bool(self.context_servers)

    @property
    def model(self) -> str:
        return self.servers[0].model

    @property
    def context_servers(self) -> tuple[ServerConfig, ...]:
        return tuple(s for s in self.servers if s.role == "context")

    @property
    def generation_servers(self) -> tuple[ServerConfig, ...]:
        return tuple(s for s in self.servers if s.role == "generation")

    @property
    def aggregated_servers(self) -> tuple[ServerConfig, ...]:
        return tuple(s for s in self.servers if s.role == "aggregated")


def load_server_config(path: str | Path, role: Role = "aggregated") -> ServerConfig:
    """The `pdserve serve --config FILE` form: model, hostname, port, engine limits, caches."""
    data = read_yaml(path)
    top = Where(str(path))
    for key in ("router", "context_servers", "generation_servers"):
        if key in data:
            raise top.key(key).error("not allowed in a server config (it describes a deployment: "
                                     "use `pdserve launch`)")
    return server_config_from_dict(data, str(path), role)


def server_config_from_dict(data: dict[str, Any], source: str = "<arguments>",
                            role: Role = "aggregated") -> ServerConfig:
    """Build one server's config from a mapping (a file's, or the command line's with source set)."""
    top = Where(source)
    top.check_keys(data, SERVER_KEYS)
    host = top.string(data, "hostname", "127.0.0.1")
    cfg = _single_server(data, top, role, host, top.port(data, "port", 8000))
    listed = top.url_list(data, "context_urls") if "context_urls" in data else []
    context_urls = tuple(host_port(h, p) for h, p in listed)
    token = cfg.cache_transceiver.get("auth_token") or env_auth_token()
    return replace(cfg, cache_transceiver={**cfg.cache_transceiver, "auth_token": token}, context_urls=context_urls)


def host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def env_auth_token() -> str | None:
    """The token from PDSERVE_AUTH_TOKEN, else from the file PDSERVE_AUTH_TOKEN_FILE names."""
    token = os.environ.get(AUTH_TOKEN_ENV)
    path = os.environ.get(AUTH_TOKEN_FILE_ENV)
    if token or not path:
        return token or None
    try:
        return Path(path).read_text().strip() or None
    except OSError as exc:
        raise ConfigError(f"{AUTH_TOKEN_FILE_ENV}={path}: cannot read the token file: {exc.strerror or exc}") from exc


def load_deployment(path: str | Path) -> DeploymentConfig:
    data = read_yaml(path)
    top = Where(str(path))
    top.check_keys(data, DEPLOYMENT_KEYS)
    host = top.string(data, "hostname", "127.0.0.1")
    host = os.environ.get(HOSTNAME_ENV) or host
    port = top.port(data, "port", 8000)
    router = top.mapping(data, "router")
    top.key("router").check_keys(router, (*ROUTER_KEYS, *ACCESS_KEYS, *ROUTING_KEYS))
    router_type = top.key("router").choice(router, "type", ROUTER_TYPES, "round_robin")
    access = router_access_from_yaml(router, top.key("router"), Path(path).resolve().parent)
    migration_limit = top.key("router").integer(router, "migration_limit", 1, minimum=0)
    routing = routing_from_yaml(router, top.key("router"))
    if routing.conditional.enabled and "context_servers" not in data:
        raise top.key("router").key("conditional").error("needs context_servers: it lets generation servers "
                                                         "serve some requests without a context leg")
    token = _auth_token(data, top)
    if "context_servers" in data and "generation_servers" not in data:
        raise top.key("generation_servers").error("required when context_servers is given")
    sections: tuple[tuple[str, Role], ...] = (("context_servers", "context"),
                                              ("generation_servers", "generation"))
    if "context_servers" not in data:  # aggregated: the generation servers run both phases
        sections = (("generation_servers", "aggregated"),)
    servers = [s for name, role in sections if name in data for s in _section_servers(data, name, role, top)]
    has_router = bool(servers)
    if not has_router:  # no server section: one aggregated server on hostname:port, no router
        servers = [_single_server(data, top, "aggregated", host, port)]
    _check_same_model(servers, top)
    _check_ports(servers, host, port, has_router, top)
    servers = _with_context_urls(share_gpu_memory(servers))
    cfg = DeploymentConfig(str(path), host, port, router_type, servers, has_router, None, access, _restart(data, top),
                           migration_limit, top.number(data, "drain_timeout_s", DEFAULT_DRAIN_TIMEOUT_S, minimum=0),
                           routing)
    return with_auth_token(cfg, token)


def _restart(data: dict[str, Any], top: Where) -> RestartPolicy:
    where, restart = top.key("restart"), top.mapping(data, "restart")
    where.check_keys(restart, RESTART_KEYS)
    default = RestartPolicy()
    return RestartPolicy(where.integer(restart, "max_quick_deaths", default.max_quick_deaths, minimum=0),
                         where.number(restart, "backoff_s", default.backoff_s, minimum=0),
                         where.number(restart, "quick_s", default.quick_s, minimum=0))


def _with_context_urls(servers: tuple[ServerConfig, ...]) -> tuple[ServerConfig, ...]:
    """Every generation server learns its deployment's context servers (where it may pull from)."""
    urls = tuple(host_port(s.host, s.port) for s in servers if s.role == "context")
    return tuple(replace(s, context_urls=urls) if s.role == "generation" else s for s in servers)


def share_gpu_memory(servers: list[ServerConfig]) -> tuple[ServerConfig, ...]:
    """The servers of one deployment run on one host and, with device auto or cuda, on its first
    GPU: where a pool is sized from free memory and no fraction was given, each of the n that may
    use the GPU gets DEFAULT_GPU_FRACTION / n of it (else the first to start takes nearly all)."""
    sharing = sum(s.device != "cpu" for s in servers)
    if sharing < 2:
        return tuple(servers)
    fraction, out = DEFAULT_GPU_FRACTION / sharing, []
    for s in servers:
        kv = s.kv_cache_config
        if s.device != "cpu" and kv.max_tokens is None and kv.free_gpu_memory_fraction is None:
            s = replace(s, kv_cache_config=replace(kv, free_gpu_memory_fraction=fraction))
        out.append(s)
    return tuple(out)


def with_auth_token(cfg: DeploymentConfig, token: str | None) -> DeploymentConfig:
    """A copy whose deployment and every server carry `token`."""
    servers = tuple(replace(s, cache_transceiver={**s.cache_transceiver, "auth_token": token})
                    for s in cfg.servers)
    return replace(cfg, servers=servers, auth_token=token)


def server_config_to_yaml(cfg: ServerConfig) -> str:
    """The `pdserve serve --config` file for one server. The role travels separately (`--role`)
    and the auth token is left out (it travels in the PDSERVE_AUTH_TOKEN environment variable)."""
    ctc = {k: v for k, v in cfg.cache_transceiver.items() if k != "auth_token"}
    data = {
        "model": cfg.model, "hostname": cfg.host, "port": cfg.port,
        "max_seq_len": cfg.max_seq_len, "max_batch_size": cfg.max_batch_size,
        "max_num_tokens": cfg.max_num_tokens, "max_prefill_batch_tokens": cfg.max_prefill_batch_tokens,
        "dtype": cfg.dtype, "device": cfg.device, "kernels": cfg.kernels, "cuda_graphs": cfg.cuda_graphs,
        "borrow_idle_cores": cfg.borrow_idle_cores, "drain_timeout_s": cfg.drain_timeout_s,
        "kv_cache_config": dataclasses.asdict(cfg.kv_cache_config), "cache_transceiver_config": ctc,
    }
    if cfg.context_urls:
        data["context_urls"] = list(cfg.context_urls)
    header = f"# generated by pdserve launch: one {cfg.role} server\n"
    return header + yaml.safe_dump(data, sort_keys=False)


def _auth_token(data: dict[str, Any], top: Where) -> str | None:
    ctc = top.mapping(data, "cache_transceiver_config")
    for section in ("context_servers", "generation_servers"):
        sec = data.get(section)
        if isinstance(sec, dict) and "auth_token" in (sec.get("cache_transceiver_config") or {}):
            where = top.key(section).key("cache_transceiver_config").key("auth_token")
            raise where.error("one token serves the whole deployment: set it at the top level")
    token = top.key("cache_transceiver_config").optional_string(ctc, "auth_token")
    return token or env_auth_token()


def _engine_settings(top_data: dict[str, Any], sec_data: dict[str, Any], top: Where,
                     sec: Where) -> dict[str, Any]:
    """Engine keys of one server: the section's value, else the top level's, else the default."""
    def pick(key: str) -> tuple[dict[str, Any], Where]:
        return (sec_data, sec) if key in sec_data else (top_data, top)

    out: dict[str, Any] = {}
    d, w = pick("model")
    if "model" not in d:
        raise top.key("model").error("required (builtin:tiny-llama or a Hugging Face model directory)")
    out["model"] = w.string(d, "model", "")
    for key, default in (("max_seq_len", 2048), ("max_batch_size", 64), ("max_num_tokens", 2048)):
        d, w = pick(key)
        out[key] = w.integer(d, key, default, minimum=1)
    d, w = pick("max_prefill_batch_tokens")
    out["max_prefill_batch_tokens"] = w.optional_integer(d, "max_prefill_batch_tokens", minimum=1)
    for key, choices in (("dtype", DTYPES), ("device", DEVICES), ("kernels", KERNELS)):
        d, w = pick(key)
        out[key] = w.choice(d, key, choices, "auto")
    d, w = pick("cuda_graphs")
    out["cuda_graphs"] = w.boolean(d, "cuda_graphs", True)
    d, w = pick("borrow_idle_cores")
    out["borrow_idle_cores"] = w.boolean(d, "borrow_idle_cores", False)
    d, w = pick("drain_timeout_s")
    out["drain_timeout_s"] = w.number(d, "drain_timeout_s", DEFAULT_DRAIN_TIMEOUT_S, minimum=0)
    out["kv_cache_config"] = _kv_cache(top_data, sec_data, top, sec)
    out["cache_transceiver"] = _transceiver(top_data, sec_data, top, sec)
    return out


def _kv_cache(top_data: dict[str, Any], sec_data: dict[str, Any], top: Where,
              sec: Where) -> KvCacheConfig:
    """Top-level keys alone first (so their errors name the top level), then the merge."""
    top_kv, sec_kv, where = _layers(top_data, sec_data, top, sec, "kv_cache_config", KvCacheConfig)
    kv = _build(KvCacheConfig.from_dict, top_kv, top.key("kv_cache_config"))
    return _build(KvCacheConfig.from_dict, {**top_kv, **sec_kv}, where) if sec_kv else kv


def _transceiver(top_data: dict[str, Any], sec_data: dict[str, Any], top: Where,
                 sec: Where) -> dict[str, Any]:
    """Merged `cache_transceiver_config`, checked against TransceiverConfig, kept as a dict."""
    top_ctc, sec_ctc, where = _layers(top_data, sec_data, top, sec, "cache_transceiver_config",
                                      TransceiverConfig)
    merged = {**top_ctc, **sec_ctc}
    _build(lambda d, _source: TransceiverConfig(**d), merged, where)
    return merged


def _layers(top_data: dict[str, Any], sec_data: dict[str, Any], top: Where, sec: Where, name: str,
            schema: type) -> tuple[dict[str, Any], dict[str, Any], Where]:
    """The top-level and section mappings of `name` (keys checked against the dataclass `schema`)
    and where a problem of the merge is reported."""
    known = tuple(f.name for f in dataclasses.fields(schema))
    top_map, sec_map = top.mapping(top_data, name), sec.mapping(sec_data, name)
    top.key(name).check_keys(top_map, known)
    sec.key(name).check_keys(sec_map, known)
    return top_map, sec_map, (sec if name in sec_data else top).key(name)


def _build(factory: Callable[[dict[str, Any], str], Any], data: dict[str, Any], where: Where) -> Any:
    """Run a component's validating constructor; its ValueError names `<path>.<key>` already."""
    path = ".".join(where.path)
    try:
        return factory(data, path)
    except ValueError as exc:
        message = str(exc)
        # TransceiverConfig names keys from `cache_transceiver_config.`; give the full path
        leaf = where.path[-1]
        if path != leaf and message.startswith(f"{leaf}."):
            message = f"{path}{message[len(leaf):]}"
        raise ConfigError(f"{where.source}: {message}") from exc


def _section_servers(data: dict[str, Any], section: str, role: Role, top: Where) -> list[ServerConfig]:
    sec = top.key(section)
    sec_data = top.mapping(data, section)
    sec.check_keys(sec_data, SECTION_KEYS)
    urls = sec.url_list(sec_data, "urls")
    count = sec.integer(sec_data, "num_instances", len(urls), minimum=1)
    if count != len(urls):
        raise sec.key("num_instances").error(f"must equal the number of urls ({len(urls)}), got {count}")
    engine = _engine_settings(data, sec_data, top, sec)
    return [ServerConfig(role=role, host=h, port=p, **engine) for h, p in urls]


def _single_server(data: dict[str, Any], top: Where, role: Role, host: str, port: int) -> ServerConfig:
    return ServerConfig(role=role, host=host, port=port, **_engine_settings(data, {}, top, top))


def _check_same_model(servers: list[ServerConfig], top: Where) -> None:
    models = {s.model for s in servers}
    if len(models) > 1:
        raise top.key("model").error(f"every server must serve the same model, got {sorted(models)}")


def _check_ports(servers: list[ServerConfig], host: str, port: int, has_router: bool, top: Where) -> None:
    """No two listeners (router, servers, context transceivers) may share a port on one host."""
    seen: list[tuple[str, int, str]] = [(host, port, "router (hostname:port)")] if has_router else []
    for s in servers:
        seen.append((s.host, s.port, f"{s.role} server {s.host}:{s.port}"))
        ctc_port = s.cache_transceiver.get("port")
        if s.role == "context" and ctc_port:  # 0: ephemeral
            seen.append((s.host, ctc_port, f"the transceiver of context server {s.host}:{s.port}"))
    for i, (h1, p1, name1) in enumerate(seen):
        for h2, p2, name2 in seen[:i]:
            if p1 == p2 and _same_host(h1, h2):
                raise top.error(f"duplicate port {p1}: {name2} and {name1}")


def _same_host(a: str, b: str) -> bool:
    if a in _WILDCARD_HOSTS or b in _WILDCARD_HOSTS:
        return True
    loopback = ("localhost", "127.0.0.1")
    return a == b or (a in loopback and b in loopback)

