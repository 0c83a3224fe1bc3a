"""The router's settings: the deployment YAML's `router:` section (keys in docs/ROUTING.md and
docs/SECURITY.md), and the one type the router runs on. Its servers, model, token and drain come
from the deployment (`DeploymentConfig.router_config`), never from `router:`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from kvcache import Level
from server.config.yaml_io import ConfigError
from server.router.auth import API_KEYS_ENV, DEFAULT_OPEN_PATHS, RouterAccess

Weight = Annotated[float, Meta(ge=0)]
Count = Annotated[int, Meta(ge=0)]
# `router.conditional` left out where the launcher runs a context and a generation server on one GPU: a
# context leg there costs a second read of the weights, which a short prefill inside the generation server's
# decode step mostly hides (8B in bf16 on an H100: the read is ~5 ms, as are the GEMMs of 256 tokens)
SHARED_GPU_LOCAL_PREFILL = 256
SHARED_GPU_ENV = "PDSERVE_PAIR_SHARES_GPU"  # set by the launcher for its router: "1" when that is so
ApiKey = Annotated[str, Meta(pattern=r"^[^\s,]+$", description="a key without spaces or commas")]
_TRAILING = "starting with '/' (a trailing * opens every path under a prefix)"
OpenPath = Annotated[str, Meta(pattern=r"^/[^*]*\*?$", description=f"a path {_TRAILING}")]
POLICIES = ("round_robin", "load_balancing", "kv_cache_aware")


class QueueLimits(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`router.queue` of the deployment YAML."""

    max_inflight_per_server: Count = 64  # 0: a server is never saturated
    max_waiting: Count = 1024
    timeout_s: Annotated[float, Meta(ge=0)] = 60.0


class KvWeights(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """kv_cache_aware's weight of a block a server holds, by its tier (router.kv_weights)."""

    primary: Weight = 1.0  # a block on the device pool (GPU; the CPU pool on a machine without one)
    secondary: Weight = 0.75  # a block on the host tier: onboarded (copied back) before reuse
    disk: Weight = 0.25  # a block on the disk tier: read back and checked, then onboarded (Dynamo's 0.25)

    def tier(self, level: int) -> float:
        return {Level.PRIMARY: self.primary, Level.SECONDARY: self.secondary, Level.DISK: self.disk}[level]


class Conditional(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Requests a generation server serves alone (prefill and decode), skipping the context leg:
    those with at most `max_local_prefill_length` prompt tokens it does not hold yet, or whose
    prompt it holds at least `min_prefix_hit` tokens of (by the router's index). None: not used."""

    max_local_prefill_length: Count | None = None
    min_prefix_hit: Annotated[int, Meta(ge=1)] | None = None

    @property
    def enabled(self) -> bool:
        return self.max_local_prefill_length is not None or self.min_prefix_hit is not None


class RouterConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`router:` of a deployment (its YAML keys first), and what the router process runs on."""

    type: Literal[POLICIES] = "round_robin"  # type: ignore[valid-type]
    migration_limit: Count = 1
    api_keys: Annotated[tuple[ApiKey, ...], Meta(min_length=1, description="a non-empty list of keys")] | None = None
    api_keys_file: str | None = None  # one key per line, `#` comments; relative to the YAML's folder
    open_paths: Annotated[tuple[OpenPath, ...], Meta(description=f"a list of paths {_TRAILING}")] = DEFAULT_OPEN_PATHS
    tenant_salt_from_api_key: bool = False
    kv_weights: KvWeights = KvWeights()
    load_weight: Weight = 1.0  # kv_cache_aware: per token a server has yet to compute for the router's legs in flight
    queue: QueueLimits = QueueLimits()
    conditional: Conditional | None = None  # None: SHARED_GPU_LOCAL_PREFILL on a shared GPU, else not used
    # from the deployment, not YAML keys (INTERNAL_KEYS)
    context_urls: tuple[str, ...] = ()
    generation_urls: tuple[str, ...] = ()  # the aggregated servers' when there is no context server
    model: str | None = None  # to tokenise prompts for the kv policies and conditional disaggregation
    auth_token: str | None = None  # the deployment's token: sent on every call to a server (server/auth.py)
    drain_timeout_s: float = 30.0  # SIGTERM: new requests get 503, those in flight finish (server/deploy/drain.py)
    request_timeout_s: float = 600.0
    health_interval_s: float = 1.0

    def __post_init__(self) -> None:
        if "/health" not in self.open_paths:
            raise ValueError("open_paths: must include /health (pdserve launch and load balancers probe it "
                             "without a key)")

    def __repr__(self) -> str:
        """Without the API keys and the token: a config's repr may reach a log."""
        shown = (f"{name}={getattr(self, name)!r}" for name in self.__struct_fields__
                 if name not in ("api_keys", "auth_token"))
        return f"RouterConfig({', '.join(shown)})"

    def access(self) -> RouterAccess:
        """Who may call the router (server/router/auth.py): the keys, open paths, tenant salts."""
        return RouterAccess(self.api_keys or (), self.open_paths, self.tenant_salt_from_api_key)

    def with_keys(self, yaml_dir: Path, source: str) -> RouterConfig:
        """A copy with every valid key: `api_keys`, `api_keys_file` and PDSERVE_API_KEYS."""
        keys = [*(self.api_keys or ()), *_keys_file(self.api_keys_file, yaml_dir, source), *_keys_env()]
        if self.tenant_salt_from_api_key and not keys:
            raise ConfigError(f"{source}: router.tenant_salt_from_api_key: needs API keys (router.api_keys, "
                              f"router.api_keys_file or {API_KEYS_ENV})")
        return msgspec.structs.replace(self, api_keys=tuple(dict.fromkeys(keys)) or None, api_keys_file=None)


INTERNAL_KEYS = ("context_urls", "generation_urls", "model", "auth_token", "drain_timeout_s", "request_timeout_s",
                 "health_interval_s")
YAML_KEYS = tuple(f.encode_name for f in msgspec.structs.fields(RouterConfig) if f.encode_name not in INTERNAL_KEYS)


def _keys_file(name: str | None, yaml_dir: Path, source: str) -> list[str]:
    if name is None:
        return []
    path, where = yaml_dir / name, f"{source}: router.api_keys_file"
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read {path}: {exc.strerror or exc}") from exc
    keys = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    if not keys:
        raise ConfigError(f"{where}: {path} holds no key (one key per line)")
    for i, key in enumerate(keys):
        if any(c.isspace() for c in key) or "," in key:
            raise ConfigError(f"{where}: key #{i + 1} must be a non-empty string without spaces or commas")
    return keys


def _keys_env() -> list[str]:
    raw = os.environ.get(API_KEYS_ENV, "")
    keys = [k.strip() for k in raw.split(",") if k.strip()]
    if raw.strip() and not keys:
        raise ConfigError(f"{API_KEYS_ENV}: holds no key (comma-separated keys)")
    for key in keys:
        if any(c.isspace() for c in key):
            raise ConfigError(f"{API_KEYS_ENV}: a key contains a space")
    return keys
