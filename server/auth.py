"""The deployment token on internal HTTP endpoints: only the deployment drives the KV plane.

Requests that carry `disaggregated_params`, release a lease or read the cache index need the
`x-pdserve-token` header; a server with no token refuses them altogether."""

from __future__ import annotations

import hashlib
import hmac

TOKEN_HEADER = "x-pdserve-token"


def token_matches(given: str | None, expected: str | None) -> bool:
    """Constant-time comparison; False whenever this process has no token."""
    if not expected or given is None:
        return False
    return hmac.compare_digest(given.encode(), expected.encode())


def token_headers(token: str | None) -> dict[str, str]:
    """Headers that authenticate an internal call (none when there is no token)."""
    return {TOKEN_HEADER: token} if token else {}


def missing_token_message(token: str | None, what: str) -> str:
    if not token:
        return f"{what} needs the deployment token, and this server has none configured"
    return f"{what} needs the deployment token (header {TOKEN_HEADER}): missing or wrong"


def disk_tier_key(token: str | None) -> bytes:
    """The key that seals a server's disk-tier files (kv_cache_config.disk): derived from the
    deployment token, so a deployment with another token neither reads nor poisons them. Without a
    token the files are checked for damage only, and the directory's permissions guard them."""
    return hmac.new((token or "").encode(), b"pdserve kv disk tier v1", hashlib.sha256).digest()
