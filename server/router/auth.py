"""Who may use the router: API keys (`Authorization: Bearer <key>`), and per-tenant cache salts.

Keys come from the deployment YAML (`router.api_keys`: a list; `router.api_keys_file`: a file of one
key per line, `#` comments, relative to the YAML's folder) and the environment (`PDSERVE_API_KEYS`,
comma-separated); all of them are valid. With no key configured the router is open, as before.
With keys, every path except `router.open_paths` (default `/health` and `/metrics`; an entry ending
in `*` opens a prefix, e.g. `/dashboard*` for the dashboard page, its feed and its files) needs one, and
a request without a valid key gets 401 in OpenAI's error shape before its body is read. Keys are
compared in constant time (SHA-256 digests, every key compared), and never logged or echoed.

`router.tenant_salt_from_api_key: true` separates tenants' prefix caches without client changes:
the router sets each request's `cache_salt` to HMAC-SHA256(deployment token, API key), and a
client's own `cache_salt` only refines it (`<tenant salt>:<client salt>`), so no client can pick
another tenant's namespace (docs/SECURITY.md).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from server.config_yaml import ConfigError, Where

API_KEYS_ENV = "PDSERVE_API_KEYS"
DEFAULT_OPEN_PATHS = ("/health", "/metrics")
ACCESS_KEYS = ("api_keys", "api_keys_file", "open_paths", "tenant_salt_from_api_key")


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


@dataclass(frozen=True)
class RouterAccess:
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    open_paths: tuple[str, ...] = DEFAULT_OPEN_PATHS
    tenant_salt_from_api_key: bool = False

    @property
    def required(self) -> bool:
        return bool(self.api_keys)

    def is_open(self, path: str) -> bool:
        """An open path needs no key: listed exactly, or under an entry ending in `*` (a prefix)."""
        return any(path.startswith(p[:-1]) if p.endswith("*") else path == p for p in self.open_paths)

    def match(self, given: str | None) -> str | None:
        """The configured key equal to `given`, or None. Constant time in `given` and in which key
        matches: equal-length digests, and every key is compared."""
        if given is None:
            return None
        digest, found = _digest(given), None
        for key in self.api_keys:
            if hmac.compare_digest(digest, _digest(key)):
                found = key
        return found


def tenant_salt(token: str | None, api_key: str) -> str:
    """The tenant's namespace: HMAC-SHA256(deployment token, API key), hex (64 characters)."""
    return hmac.new((token or "").encode(), api_key.encode(), hashlib.sha256).hexdigest()


def effective_cache_salt(access: RouterAccess, token: str | None, api_key: str | None,
                         client_salt: str | None) -> str | None:
    """The cache_salt the servers get. Without tenant salts, the client's. With them, the tenant's
    salt, refined by the client's: `tenant` is fixed-length hex, so `tenant:client` is injective and
    no two tenants' namespaces meet."""
    if not access.tenant_salt_from_api_key or api_key is None:
        return client_salt
    tenant = tenant_salt(token, api_key)
    return tenant if client_salt is None else f"{tenant}:{client_salt}"


def set_cache_salt(body: dict, access: RouterAccess, token: str | None, api_key: str | None) -> str | None:
    """Put the effective cache_salt into a request body for the servers; a sentence if the client's
    salt is not a non-empty string (then the body is left as it was)."""
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        return "cache_salt must be a non-empty string if provided"
    effective = effective_cache_salt(access, token, api_key, salt)
    if effective is not None:
        body["cache_salt"] = effective
    return None


def _bearer(scope: Scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, credentials = value.decode("latin-1").partition(" ")
            return credentials.strip() if scheme.lower() == "bearer" and credentials.strip() else None
    return None


def unauthorized(message: str, code: str) -> JSONResponse:
    body = {"error": {"message": message, "type": "authentication_error", "param": None, "code": code}}
    return JSONResponse(body, 401, headers={"www-authenticate": "Bearer"})


class ApiKeyMiddleware:
    """ASGI middleware: 401 unless the path is open or the request carries a valid key; the key
    found is left in `request.state.api_key` (the tenant's salt is derived from it)."""

    def __init__(self, app: ASGIApp, access: RouterAccess) -> None:
        self.app, self.access = app, access

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.access.required or self.access.is_open(scope["path"]):
            await self.app(scope, receive, send)
            return
        given = _bearer(scope)
        key = self.access.match(given)
        if key is None:
            response = unauthorized(
                "invalid API key" if given else "missing API key: send the header Authorization: Bearer <key>",
                "invalid_api_key" if given else "missing_api_key")
            await response(scope, receive, send)
            return
        scope.setdefault("state", {})["api_key"] = key
        await self.app(scope, receive, send)


# ---- configuration (`router:` section of the deployment YAML) ----------------------------------------

def router_access_from_yaml(router: dict[str, Any], where: Where, yaml_dir: Path) -> RouterAccess:
    """Read the access keys of the `router:` mapping; errors name the file and the key."""
    keys = _keys_list(router, where) + _keys_file(router, where, yaml_dir) + _keys_env()
    open_paths = _open_paths(router, where)
    tenant = where.boolean(router, "tenant_salt_from_api_key", False)
    if tenant and not keys:
        raise where.key("tenant_salt_from_api_key").error(
            f"needs API keys (router.api_keys, router.api_keys_file or {API_KEYS_ENV})")
    return RouterAccess(tuple(dict.fromkeys(keys)), open_paths, tenant)


def _checked_keys(keys: Iterable[object], where: Where) -> list[str]:
    out = []
    for i, key in enumerate(keys):
        if not isinstance(key, str) or not key or any(c.isspace() for c in key) or "," in key:
            raise where.error(f"key #{i + 1} must be a non-empty string without spaces or commas")
        out.append(key)
    return out


def _keys_list(router: dict[str, Any], where: Where) -> list[str]:
    value = router.get("api_keys")
    if value is None:
        return []
    if not isinstance(value, list) or not value:
        raise where.key("api_keys").error("must be a non-empty list of keys")
    return _checked_keys(value, where.key("api_keys"))


def _keys_file(router: dict[str, Any], where: Where, yaml_dir: Path) -> list[str]:
    name = where.optional_string(router, "api_keys_file")
    if name is None:
        return []
    path = yaml_dir / name
    try:
        text = path.read_text()
    except OSError as exc:
        raise where.key("api_keys_file").error(f"cannot read {path}: {exc.strerror or exc}") from exc
    lines = [line.strip() for line in text.splitlines()]
    keys = [line for line in lines if line and not line.startswith("#")]
    if not keys:
        raise where.key("api_keys_file").error(f"{path} holds no key (one key per line)")
    return _checked_keys(keys, where.key("api_keys_file"))


def _keys_env() -> list[str]:
    raw = os.environ.get(API_KEYS_ENV, "")
    keys = [k.strip() for k in raw.split(",") if k.strip()]
    if raw.strip() and not keys:
        raise ConfigError(f"{API_KEYS_ENV}: holds no key (comma-separated keys)")
    for key in keys:
        if any(c.isspace() for c in key):
            raise ConfigError(f"{API_KEYS_ENV}: a key contains a space")
    return keys


def _open_paths(router: dict[str, Any], where: Where) -> tuple[str, ...]:
    value = router.get("open_paths", list(DEFAULT_OPEN_PATHS))
    w = where.key("open_paths")
    if not isinstance(value, list) or not all(isinstance(p, str) and p.startswith("/") and "*" not in p[:-1]
                                              for p in value):
        raise w.error(f"must be a list of paths starting with '/' (a trailing * opens every path under a "
                      f"prefix), got {value!r}")
    if "/health" not in value:
        raise w.error("must include /health (pdserve launch and load balancers probe it without a key)")
    return tuple(value)
