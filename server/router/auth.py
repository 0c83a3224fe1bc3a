"""Who may use the router: API keys (`Authorization: Bearer <key>`), and per-tenant cache salts.

Keys come from `router.api_keys`, `router.api_keys_file` and PDSERVE_API_KEYS; none: the router is
open. With keys, every path but `router.open_paths` needs one (401 before the body is read). Keys
are compared in constant time and never logged. `tenant_salt_from_api_key` sets each request's
`cache_salt` to HMAC-SHA256(token, key), refined by the client's own (docs/SECURITY.md)."""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field
from functools import cached_property

from starlette.types import ASGIApp, Receive, Scope, Send

from server.openai.errors import error_response

API_KEYS_ENV = "PDSERVE_API_KEYS"
DEFAULT_OPEN_PATHS = ("/health", "/metrics")


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


@dataclass(frozen=True)
class RouterAccess:
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    open_paths: tuple[str, ...] = DEFAULT_OPEN_PATHS
    tenant_salt_from_api_key: bool = False

    def is_open(self, path: str) -> bool:
        """An open path needs no key: listed exactly, or under an entry ending in `*` (a prefix)."""
        return any(path.startswith(p[:-1]) if p.endswith("*") else path == p for p in self.open_paths)

    def match(self, given: str | None) -> str | None:
        """The configured key equal to `given`, or None. Constant time in `given` and in which key
        matches: equal-length digests, and every key is compared."""
        if given is None:
            return None
        digest, found = _digest(given), None
        for key, key_digest in zip(self.api_keys, self._key_digests, strict=True):
            if hmac.compare_digest(digest, key_digest):
                found = key
        return found

    @cached_property
    def _key_digests(self) -> tuple[bytes, ...]:
        """Each configured key's digest, made once (not per request)."""
        return tuple(_digest(key) for key in self.api_keys)


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
    """Put the effective cache_salt into a body for the servers; a sentence if the client's is bad."""
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


class ApiKeyMiddleware:
    """401 unless the path is open or the request carries a valid key (kept in `request.state.api_key`)."""

    def __init__(self, app: ASGIApp, access: RouterAccess) -> None:
        self.app, self.access = app, access

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.access.api_keys or self.access.is_open(scope["path"]):
            await self.app(scope, receive, send)
            return
        given = _bearer(scope)
        key = self.access.match(given)
        if key is None:
            message = "invalid API key" if given else "missing API key: send the header Authorization: Bearer <key>"
            response = error_response(401, message, code="invalid_api_key" if given else "missing_api_key",
                                      headers={"www-authenticate": "Bearer"})
            await response(scope, receive, send)
            return
        scope.setdefault("state", {})["api_key"] = key
        await self.app(scope, receive, send)
