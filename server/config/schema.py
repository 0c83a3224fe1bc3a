"""The deployment YAML as one declared schema: msgspec Structs, each key and its default declared once.

`ServerConfig` is one engine process. A deployment file has TensorRT-LLM's `trtllm-serve
disaggregated` shape: top-level engine keys are inherited by `context_servers` and
`generation_servers` (`inherit`; the config sections merge key by key). Without `context_servers`
it runs aggregated; with no server section, one server listens on `hostname:port`, no router.
Every problem raises ConfigError `<file>: <key.path>: <what is wrong>`. PDSERVE_HOSTNAME replaces
the top-level `hostname`; PDSERVE_AUTH_TOKEN (or the file PDSERVE_AUTH_TOKEN_FILE names) supplies
the token when the file leaves it null."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta
from msgspec.structs import replace

from kvcache.config import KvCacheConfig
from kvcache.kv_scales import read_scales
from server.config.router import SHARED_GPU_LOCAL_PREFILL, Conditional, RouterConfig
from server.config.router import YAML_KEYS as ROUTER_KEYS
from server.config.yaml_io import ConfigError, KeyPath, check_keys, convert, read_yaml
from server.engine.speculative.config import SpeculativeConfig
from server.models.catalog import attention_heads
from server.models.parallel.plan import tp_problem
from transceiver.config import TransceiverConfig

Role = Literal["aggregated", "context", "generation"]
HOSTNAME_ENV = "PDSERVE_HOSTNAME"
AUTH_TOKEN_ENV = "PDSERVE_AUTH_TOKEN"
AUTH_TOKEN_FILE_ENV = "PDSERVE_AUTH_TOKEN_FILE"  # a file holding the token (operators restarting by hand)

Positive = Annotated[int, Meta(ge=1)]
Amount = Annotated[float, Meta(ge=0)]  # seconds, or a Ray actor's CPUs and GPUs
Port = Annotated[int, Meta(ge=1, le=65535)]
Host = Annotated[str, Meta(min_length=1)]
HostPort = Annotated[str, Meta(pattern=r"^(\[[^\]\s/]+\]|[^:\s/\[\]]+):\d{1,5}$",  # IPv6 in brackets
                               description="host:port (like 127.0.0.1:8001)")]
DEFAULT_DRAIN_TIMEOUT_S = 30.0
Percent = Annotated[int, Meta(ge=1, le=100)]
GpuShare = Annotated[Literal["auto", "off"] | Percent,
                     Meta(description="auto, off or a percent of the GPU's SMs (1..100)")]
# the CUDA MPS variables that `gpu_share` sets (server/deploy/mps.py): not in `env` unless it is off
MPS_ENV = ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY")
# keys whose values include the words on/off, which YAML 1.1 reads as booleans (`kv_stream: off`)
SWITCH_KEYS = ("kv_stream", "gpu_share")
ROUTER = "router"  # the router's key in DeploymentConfig.ray_actor_options
DEFAULT_NUM_CPUS = 1.0  # Ray Serve's default for a replica's actor

class RayActorOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`ray_actor_options` (Ray Serve's key; docs/DEPLOY.md): the resources of one actor under `pdserve
    launch --ray` (one rank of a tensor-parallel server), and its runtime env. The one-host launcher
    ignores it; nothing here imports Ray."""

    num_cpus: Amount = DEFAULT_NUM_CPUS
    num_gpus: Amount = 0.0
    resources: dict[str, Any] = {}  # checked by __post_init__ (msgspec's path of a dict value names no key)
    runtime_env: dict[str, Any] = {}

    def __post_init__(self) -> None:
        for name, amount in self.resources.items():
            if name in ("CPU", "GPU"):
                raise ValueError(f"resources.{name}: give it as num_{name.lower()}s")
            if isinstance(amount, bool) or not isinstance(amount, int | float) or amount < 0:
                raise ValueError(f"resources.{name}: must be a number >= 0, got {amount!r}")
        if not (self.num_cpus or self.num_gpus or any(self.resources.values())):
            raise ValueError("num_cpus: an actor must ask for some resource (num_cpus, num_gpus or resources)")

    def bundle(self) -> dict[str, float]:
        """One placement group bundle: the resources of one actor."""
        out = {"CPU": self.num_cpus, "GPU": self.num_gpus, **self.resources}
        return {k: v for k, v in out.items() if v}


class ServerConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One engine process."""

    model: Annotated[str, Meta(min_length=1, description="builtin:tiny-llama or a Hugging Face model directory")]
    host: Host = msgspec.field(default="127.0.0.1", name="hostname")
    port: Port = 8000
    max_seq_len: Positive = 2048
    max_batch_size: Positive = 64
    max_num_tokens: Positive = 2048
    # a step starts no more waiting prompts once it prefills this many; None: server/engine_host/build.py's
    max_prefill_batch_tokens: Positive | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # auto: Triton kernels (paged attention, fused norms/RoPE) on CUDA when Triton is installed
    kernels: Literal["auto", "torch", "triton"] = "auto"
    cuda_graphs: bool = True  # with Triton kernels: decode steps replay graphs captured at start-up
    # fp8: a float checkpoint's linear layers quantized to FP8 e4m3 at load (docs/FP8.md)
    quantization: Literal["fp8"] | None = None
    # ranks, one process each (rank r on cuda:r); must divide the attention heads (tp_problem)
    tensor_parallel_size: Positive = 1
    # a MoE model's routed experts: 1 splits each expert's intermediate dimension over the ranks;
    # tensor_parallel_size spreads whole experts over them (docs/MODELS.md)
    expert_parallel_size: Positive = 1
    # with expert_parallel_size > 1: all_reduce (every rank routes every token to its own experts and the
    # block's all-reduce sums the ranks') or all_to_all (tokens sent to their experts' ranks and back)
    expert_dispatch: Literal["all_reduce", "all_to_all"] = "all_reduce"
    # the engine in a process of its own (true) or on a thread (false); auto: its own process on CUDA
    engine_process: Annotated[Literal["auto"] | bool, Meta(description="auto, true or false")] = "auto"
    # schedule step k+1 while the GPU runs step k; auto: on CUDA only (docs/GPU.md)
    async_scheduling: Literal["auto"] | bool = "auto"
    kv_cache_config: KvCacheConfig = KvCacheConfig()
    # speculative decoding (server/engine/speculative/): method off | ngram | draft_model, default off
    speculative: SpeculativeConfig = SpeculativeConfig()
    # its `host` is the server's own unless the file sets it; its auth_token the deployment's
    cache_transceiver_config: TransceiverConfig = TransceiverConfig()
    # context servers: send a prompt's KV while it is prefilled (docs/KV_STREAM.md); auto: prompts
    # prefilled in several steps (over max_num_tokens)
    kv_stream: Literal["auto", "on", "off"] = "auto"
    # SIGTERM: refuse new requests, let those in flight and their KV transfers end, at most this long
    drain_timeout_s: Amount = DEFAULT_DRAIN_TIMEOUT_S
    # the most choices (`n`) a completions or chat request may ask for per prompt (a 400 naming n above it)
    max_n: Positive = 16
    # generation servers: the deployment's context servers; KV is pulled only from their KV senders
    context_urls: tuple[HostPort, ...] = ()
    # extra environment of this server's process under `pdserve launch` (CUDA_VISIBLE_DEVICES, ...)
    env: dict[str, str] = {}  # checked and made strings by _env (YAML writes `CUDA_VISIBLE_DEVICES: 0`)
    # this server's percent of the SMs of a GPU it shares under CUDA MPS, 100 (a cap below is refused,
    # docs/DEPLOY.md; server/deploy/gpu_share.py); off: never under MPS
    gpu_share: GpuShare = "auto"
    role: Role = "aggregated"  # set by the section (a deployment) or `--role`, never in the file

    def __post_init__(self) -> None:
        _check_ports_in("context_urls", self.context_urls)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


RAY_PLACES = "only `pdserve launch --ray` places servers without urls (num_instances of them)"
PLACEMENT_KEYS = ("role", "hostname", "port", "context_urls")
ENGINE_KEYS = tuple(f.encode_name for f in msgspec.structs.fields(ServerConfig) if f.encode_name not in PLACEMENT_KEYS)
MERGED_KEYS = ("kv_cache_config", "cache_transceiver_config", "speculative")  # a section overrides these key by key


class RestartPolicy(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`restart:` of a deployment: a death within `quick_s` of a start is quick; the launcher restarts
    after `backoff_s`, doubled per quick death in a row (at most 30 s), and gives up after
    `max_quick_deaths` of them (0: never restarts)."""

    max_quick_deaths: Annotated[int, Meta(ge=0)] = 5
    backoff_s: Amount = 1.0
    quick_s: Amount = 60.0


class Section(msgspec.Struct, kw_only=True):
    """`context_servers` / `generation_servers`: where the servers listen; any engine key besides."""

    num_instances: Positive | None = None  # if given, must equal len(urls)
    # required, except under `pdserve launch --ray`, which places num_instances servers and learns
    # their addresses (server/deploy/ray/)
    urls: Annotated[tuple[HostPort, ...], Meta(min_length=1, description="a non-empty list of host:port strings")] \
        | None = None
    ray_actor_options: RayActorOptions = RayActorOptions()  # each server's (each rank's) placement on Ray

    def __post_init__(self) -> None:
        if self.urls is None:
            if self.num_instances is None:
                raise ValueError(f"urls: required (a non-empty list of host:port strings); {RAY_PLACES}")
            return
        _check_ports_in("urls", self.urls)
        if self.num_instances not in (None, len(self.urls)):
            raise ValueError(f"num_instances: must equal the number of urls ({len(self.urls)}), "
                             f"got {self.num_instances}")


class DeploymentFile(msgspec.Struct, kw_only=True):
    """A deployment file's own keys; its engine keys are read per server (`inherit`)."""

    hostname: Host = "127.0.0.1"  # the router's (or the single server's)
    port: Port = 8000
    router: RouterConfig = RouterConfig()
    restart: RestartPolicy = RestartPolicy()
    drain_timeout_s: Amount = DEFAULT_DRAIN_TIMEOUT_S  # the router's; the servers inherit the same key
    # the router's placement on Ray (or the single server's); never inherited by the sections
    ray_actor_options: RayActorOptions = RayActorOptions()
    context_servers: Section | None = None
    generation_servers: Section | None = None

    def __post_init__(self) -> None:
        if self.context_servers and not self.generation_servers:
            raise ValueError("generation_servers: required when context_servers is given")
        if self.router.conditional is not None and self.router.conditional.enabled and not self.context_servers:
            raise ValueError("router.conditional: needs context_servers: it lets generation servers serve some "
                             "requests without a context leg")


DEPLOYMENT_KEYS = tuple(f.encode_name for f in msgspec.structs.fields(DeploymentFile))
SECTION_KEYS = tuple(f.encode_name for f in msgspec.structs.fields(Section))


class DeploymentConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The whole deployment. `servers` keeps file order: context servers, then generation ones."""

    source: str
    host: str  # router address, or the single aggregated server's when has_router is False
    port: int
    servers: tuple[ServerConfig, ...]
    has_router: bool
    auth_token: str | None  # None: the launcher makes one per deployment
    router: RouterConfig  # `router:`, its API keys read (api_keys_file, PDSERVE_API_KEYS)
    restart: RestartPolicy
    drain_timeout_s: float  # the router's (the top level's `drain_timeout_s`; servers have their own)
    # placement under `pdserve launch --ray`: by server name, and "router" (the top level's)
    ray_actor_options: dict[str, RayActorOptions] = {}

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

    def router_config(self, shared_gpu: bool = False) -> RouterConfig:
        """What `pdserve router` runs on: `router:` with the deployment's servers, model, token and drain;
        `shared_gpu`: the launcher runs a context and a generation server on one GPU (the default
        `router.conditional` then serves short prefills on the generation server)."""
        front = self.generation_servers if self.disaggregated else self.aggregated_servers
        conditional = self.router.conditional
        if conditional is None:
            local = SHARED_GPU_LOCAL_PREFILL if shared_gpu and self.disaggregated else None
            conditional = Conditional(max_local_prefill_length=local)
        return replace(self.router, conditional=conditional,
                       context_urls=tuple(f"{s.host}:{s.port}" for s in self.context_servers),
                       generation_urls=tuple(f"{s.host}:{s.port}" for s in front), model=self.model,
                       auth_token=self.auth_token, drain_timeout_s=self.drain_timeout_s)

    def named(self) -> dict[str, ServerConfig]:
        """Every server by its name, `<role>-<index within the role>` (context-0, generation-1)."""
        roles = [s.role for s in self.servers]
        return {f"{s.role}-{roles[:i].count(s.role)}": s for i, s in enumerate(self.servers)}


# ---- loading ---------------------------------------------------------------------------------------

def load_server_config(path: str | Path, role: Role = "aggregated") -> ServerConfig:
    """The `pdserve serve --config FILE` form: model, hostname, port, engine limits, caches."""
    data = read_yaml(path)
    for key in ("router", "context_servers", "generation_servers"):
        if key in data:
            raise ConfigError(f"{path}: {key}: not allowed in a server config (it describes a deployment: "
                              "use `pdserve launch`, or `pdserve serve --config FILE --server NAME`)")
    return server_config_from_dict(data, str(path), role)


def server_config_from_dict(data: dict[str, Any], source: str = "<arguments>",
                            role: Role = "aggregated") -> ServerConfig:
    """One server's config from a mapping (a file's, or the command line's with source set)."""
    check_keys(data, (*ENGINE_KEYS, *PLACEMENT_KEYS[1:]), source, [])
    cfg = _server(dict(data), role, source)
    token = cfg.cache_transceiver_config.auth_token or env_auth_token()
    return replace(cfg, cache_transceiver_config=replace(cfg.cache_transceiver_config, auth_token=token))


def load_server(path: str | Path, name: str) -> ServerConfig:
    """The server called `name` (context-0, generation-1, aggregated-0) of the deployment in `path`."""
    servers = load_deployment(path).named()
    if name not in servers:
        raise ConfigError(f"{path}: no server {name!r}; the deployment has {', '.join(servers)}")
    return servers[name]


def load_deployment(path: str | Path) -> DeploymentConfig:
    return deployment_from_dict(read_yaml(path), str(path), Path(path).resolve().parent)


def deployment_from_dict(data: dict[str, Any], source: str, base_dir: Path) -> DeploymentConfig:
    """A deployment from a file's mapping (`source` names it in errors; relative paths from `base_dir`)."""
    check_keys(data, (*DEPLOYMENT_KEYS, *ENGINE_KEYS), source, [])
    if isinstance(data.get("router"), dict):
        check_keys(data["router"], ROUTER_KEYS, source, ["router"])
    file = convert(data, DeploymentFile, source)
    host = os.environ.get(HOSTNAME_ENV) or file.hostname
    servers, placement = _section_servers(data, file, source)
    has_router = bool(servers)
    if not has_router:  # no server section: one aggregated server on hostname:port, no router
        servers = [_server({**inherit(data, {}), "hostname": host, "port": file.port}, "aggregated", source)]
        placement = [file.ray_actor_options]
    check_same_model(servers, source)
    check_ports(servers, (host, file.port) if has_router else None, source)
    check_disk_paths(servers, source)
    check_kv_formats(servers, source)
    cfg = DeploymentConfig(
        source=source, host=host, port=file.port, servers=tuple(servers), has_router=has_router, auth_token=None,
        router=file.router.with_keys(base_dir, source), restart=file.restart, drain_timeout_s=file.drain_timeout_s)
    names = list(cfg.named())
    options = {**dict(zip(names, placement, strict=True)), **({ROUTER: file.ray_actor_options} if has_router else {})}
    ctc = data.get("cache_transceiver_config")
    token = ctc.get("auth_token") if isinstance(ctc, dict) else None  # its type: checked per server
    return with_auth_token(replace(cfg, ray_actor_options=options), token or env_auth_token())


def inherit(top: dict[str, Any], section: dict[str, Any]) -> dict[str, Any]:
    """One server's engine keys, TensorRT-LLM's way: the top level's, then its section's on top;
    `kv_cache_config` and `cache_transceiver_config` merge key by key (the section's keys win)."""
    out = {k: v for k, v in top.items() if k in ENGINE_KEYS}
    for key, value in section.items():
        if key in ENGINE_KEYS and not (key in MERGED_KEYS and value is None):  # null: the top level's
            below = out.get(key)
            merge = key in MERGED_KEYS and isinstance(below, dict) and isinstance(value, dict)
            out[key] = {**below, **value} if merge else value
    return out


def _section_servers(data: dict[str, Any], file: DeploymentFile,
                     source: str) -> tuple[list[ServerConfig], list[RayActorOptions]]:
    """The sections' servers in file order, and each one's placement on Ray."""
    roles: tuple[tuple[str, Role], ...] = (("context_servers", "context"), ("generation_servers", "generation"))
    if file.context_servers is None:  # aggregated: the generation servers run both phases
        roles = (("generation_servers", "aggregated"),)
    servers, placement = [], []
    for name, role in roles:
        section: Section | None = getattr(file, name)
        if section is None:
            continue
        if section.urls is None:
            raise ConfigError(f"{source}: {name}.urls: required (a non-empty list of host:port strings); {RAY_PLACES}")
        raw = data[name]
        check_keys(raw, (*SECTION_KEYS, *ENGINE_KEYS), source, [name])
        if "auth_token" in (raw.get("cache_transceiver_config") or {}):
            raise ConfigError(f"{source}: {name}.cache_transceiver_config.auth_token: one token serves the whole "
                              "deployment: set it at the top level")
        # where a key of the section's servers was written: in the section, or (inherited) at the top level
        origin = lambda path, name=name, raw=raw: [name, *path] if _written(raw, path) else path
        for url in section.urls:
            host, port = split_host_port(url)
            settings = {**inherit(data, raw), "hostname": host, "port": port}
            servers.append(_server(settings, role, source, origin))
            placement.append(section.ray_actor_options)
    servers = share_gpu_memory(servers)
    urls = tuple(host_port(s.host, s.port) for s in servers if s.role == "context")
    return [replace(s, context_urls=urls) if s.role == "generation" else s for s in servers], placement


def _server(settings: dict[str, Any], role: Role, source: str, origin=list) -> ServerConfig:
    """Convert one server's settings; its transceiver binds beside it unless the file says where."""
    if "env" in settings:
        settings = {**settings, "env": _env(settings["env"], source, origin)}
    settings = {**settings, **{key: "off" if settings[key] is False else "on" for key in SWITCH_KEYS
                               if isinstance(settings.get(key), bool)}}
    cfg = convert({**settings, "role": role}, ServerConfig, source, origin)
    _check_tensor_parallel(cfg, source, origin)
    _check_mps_env(cfg, source, origin)
    if _written(settings, ["cache_transceiver_config", "host"]):
        return cfg
    return replace(cfg, cache_transceiver_config=replace(cfg.cache_transceiver_config, host=cfg.host))


ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _env(env: Any, source: str, origin) -> dict[str, str]:
    """`env:` as strings; names must be variable names, values scalars; the token is the launcher's."""
    where = lambda *path: f"{source}: {'.'.join(origin(['env', *path]))}"
    if not isinstance(env, dict):
        raise ConfigError(f"{where()}: must be a mapping of variable names to values, got {type(env).__name__}")
    out = {}
    for name, value in env.items():
        if not isinstance(name, str) or not ENV_NAME.fullmatch(name):
            raise ConfigError(f"{where()}: {name!r} is not an environment variable name")
        if name.startswith("PDSERVE_AUTH_TOKEN"):
            raise ConfigError(f"{where(name)}: the launcher sets it (cache_transceiver_config.auth_token "
                              "sets the token)")
        if isinstance(value, bool) or not isinstance(value, str | int | float):
            raise ConfigError(f"{where(name)}: must be a string or a number, got {type(value).__name__}")
        out[name] = str(value)
    return out


def _check_mps_env(cfg: ServerConfig, source: str, origin) -> None:
    """`gpu_share` sets the CUDA MPS variables; `env` may set them only when it is off (MPS run by hand)."""
    if cfg.gpu_share == "off":
        return
    if isinstance(cfg.gpu_share, int) and cfg.gpu_share < 100:
        raise ConfigError(f"{source}: {'.'.join(origin(['gpu_share']))}: an SM cap below 100 is refused: under "
                          f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={cfg.gpu_share} an H100 computed NaN logits "
                          "(docs/GPU.md); use auto (CUDA MPS without a cap), 100 or off")
    for name in MPS_ENV:
        if name in cfg.env:
            how = "give the share as gpu_share: <percent>" if name == MPS_ENV[0] else "the launcher's daemon sets it"
            raise ConfigError(f"{source}: {'.'.join(origin(['env', name]))}: set by gpu_share ({how}); "
                              "set gpu_share: off to run CUDA MPS yourself")


def _check_tensor_parallel(cfg: ServerConfig, source: str, origin) -> None:
    heads = attention_heads(cfg.model)
    problem = None if heads is None else tp_problem(*heads, cfg.tensor_parallel_size)
    if problem is not None:
        raise ConfigError(f"{source}: {'.'.join(origin(['tensor_parallel_size']))}: {problem}")
    if cfg.expert_parallel_size not in (1, cfg.tensor_parallel_size):
        raise ConfigError(f"{source}: {'.'.join(origin(['expert_parallel_size']))}: {cfg.expert_parallel_size}: "
                          f"must be 1 or tensor_parallel_size ({cfg.tensor_parallel_size}): experts are spread "
                          "over a server's tensor-parallel ranks")
    if cfg.expert_dispatch == "all_to_all" and cfg.expert_parallel_size == 1:
        raise ConfigError(f"{source}: {'.'.join(origin(['expert_dispatch']))}: all_to_all sends tokens to the ranks "
                          "that hold their experts: it needs expert_parallel_size > 1")


def _written(data: Any, path: KeyPath) -> bool:
    for part in path:
        if not isinstance(data, dict) or part not in data:
            return False
        data = data[part]
    return True


def _check_ports_in(key: str, urls: tuple[str, ...]) -> None:
    for i, url in enumerate(urls):
        port = split_host_port(url)[1]
        if not 1 <= port <= 65535:
            raise ValueError(f"{key}[{i}]: must be a port in 1..65535, got {port}")


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


def with_auth_token(cfg: DeploymentConfig, token: str | None) -> DeploymentConfig:
    """A copy whose deployment and every server carry `token`."""
    servers = tuple(replace(s, cache_transceiver_config=replace(s.cache_transceiver_config, auth_token=token))
                    for s in cfg.servers)
    return replace(cfg, servers=servers, auth_token=token)


# ---- rules that span a deployment's servers (one model with one quantization, no shared port, the
# GPU's memory shared out, one KV format across the pair), and host:port strings ----------------------

# hosts that bind every interface, so they collide with any host on the same port
_WILDCARD_HOSTS = ("0.0.0.0", "::", "")
_LOOPBACK = ("localhost", "127.0.0.1")
CHECKPOINT_SCALES = "the checkpoint's (or 1.0)"  # an FP8 KV cache's scales where kv_cache_config.scales is null


def host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def split_host_port(url: str) -> tuple[str, int]:
    """`host:port` (IPv6 hosts in brackets) -> (host, port)."""
    host, _, port = url.rpartition(":")
    return host.strip("[]"), int(port)


def check_same_model(servers: list[ServerConfig], source: str) -> None:
    models = {s.model for s in servers}
    if len(models) > 1:
        raise ConfigError(f"{source}: model: every server must serve the same model, got {sorted(models)}")
    quantizations = {str(s.quantization) for s in servers}  # one model's KV, prefixes and tokens: the same weights
    if len(quantizations) > 1:
        raise ConfigError(f"{source}: quantization: every server must serve the same weights, got "
                          f"{sorted(quantizations)} (set it at the top level)")


def check_ports(servers: list[ServerConfig], router: tuple[str, int] | None, source: str) -> None:
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


def check_disk_paths(servers: list[ServerConfig], source: str) -> None:
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


def check_kv_formats(servers: list[ServerConfig], source: str) -> None:
    """A context server's KV blocks reach a generation server as they are: both must have the same
    kv_cache_config.dtype and, for FP8, equal scales. Refused here, naming both servers."""
    generation = [s for s in servers if s.role == "generation"]
    for ctx in (s for s in servers if s.role == "context"):
        for gen in generation:
            problem = _kv_format_difference(ctx, gen, source)
            if problem is not None:
                raise ConfigError(f"{source}: kv_cache_config.{problem}")


def _kv_format_difference(ctx: ServerConfig, gen: ServerConfig, source: str) -> str | None:
    a, b = ctx.kv_cache_config, gen.kv_cache_config
    names = f"context server {host_port(ctx.host, ctx.port)}", f"generation server {host_port(gen.host, gen.port)}"
    if a.dtype != b.dtype:
        return f"dtype differs: {names[0]} has {a.dtype!r}, {names[1]} has {b.dtype!r}"
    if a.dtype != "fp8" or a.scales == b.scales:
        return None
    if a.scales is None or b.scales is None:
        where = [f"{name} {repr(p) if p is not None else CHECKPOINT_SCALES}"
                 for name, p in zip(names, (a.scales, b.scales), strict=True)]
        return f"scales differ: {where[0]}, {where[1]}"
    try:
        if read_scales(a.scales) != read_scales(b.scales):
            return f"scales differ: {names[0]} has {a.scales!r}, {names[1]} has {b.scales!r}, of other values"
    except ValueError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    return None


def _same_host(a: str, b: str) -> bool:
    if a in _WILDCARD_HOSTS or b in _WILDCARD_HOSTS:
        return True
    return a == b or (a in _LOOPBACK and b in _LOOPBACK)


def share_gpu_memory(servers: list[ServerConfig]) -> list[ServerConfig]:
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
