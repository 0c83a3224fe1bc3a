"""`cache_transceiver_config`: settings of the KV transceiver, loaded from the deployment YAML."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

MIN_CHUNK_BYTES = 64 * 1024  # pyzmq copies frames below 64 KiB even with copy=False
MAX_CHUNK_BYTES = 1024 * 1024 * 1024
MIN_TOKEN_CHARS = 16


@dataclass(frozen=True)
class TransceiverConfig:
    """How one server's transceiver listens, authenticates and times out.

    `auth_token` may be None in YAML only: the launcher then generates one per deployment and
    hands every server a copy with `dataclasses.replace`; a sender or receiver refuses to start
    without one (`token_bytes`).
    """

    kv_transfer_timeout_ms: int = 60000
    auth_token: str | None = None
    host: str = "127.0.0.1"
    port: int = 0  # 0: an ephemeral port, advertised through `KVSender.endpoint`
    max_chunk_bytes: int = 8 * 1024 * 1024  # payload bytes per chunk message (and per frame)
    same_host_ipc: bool = True  # CUDA pools on one GPU: copy device-to-device via CUDA IPC (false: bytes)

    def __post_init__(self) -> None:
        problem = _first_problem(self)
        if problem is not None:
            raise ValueError(f"cache_transceiver_config.{problem[0]}: {problem[1]}")

    @property
    def timeout_s(self) -> float:
        return self.kv_transfer_timeout_ms / 1000.0

    def token_bytes(self) -> bytes:
        """The HMAC key; raises when no token was configured or generated."""
        if self.auth_token is None:
            raise ValueError(
                "cache_transceiver_config.auth_token is not set: configure one or let the launcher "
                "generate one per deployment (the transceiver never runs unauthenticated)"
            )
        return self.auth_token.encode()

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None, source: str) -> TransceiverConfig:
        """Build from the YAML mapping; any error names the key and `source` (the file)."""
        if d is None:
            return cls()
        if not isinstance(d, dict):
            raise ValueError(f"cache_transceiver_config in {source}: expected a mapping, got {d!r}")
        known = {f.name for f in fields(cls)}
        for key in d:
            if key not in known:
                raise ValueError(
                    f"cache_transceiver_config.{key} in {source}: unknown key (known: {sorted(known)})"
                )
        try:
            return cls(**d)
        except ValueError as e:
            raise ValueError(f"{e} (in {source})") from None


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _first_problem(c: TransceiverConfig) -> tuple[str, str] | None:
    """(key, what is wrong) for the first invalid field, or None."""
    if not _is_int(c.kv_transfer_timeout_ms) or c.kv_transfer_timeout_ms <= 0:
        return "kv_transfer_timeout_ms", f"expected a positive integer, got {c.kv_transfer_timeout_ms!r}"
    token = c.auth_token
    if token is not None and (not isinstance(token, str) or len(token) < MIN_TOKEN_CHARS):
        return "auth_token", f"expected null or a string of at least {MIN_TOKEN_CHARS} characters"
    if not isinstance(c.host, str) or not c.host or c.host.strip() != c.host:
        return "host", f"expected an interface address such as 127.0.0.1, got {c.host!r}"
    if not _is_int(c.port) or not 0 <= c.port <= 65535:
        return "port", f"expected an integer in 0..65535, got {c.port!r}"
    chunk = c.max_chunk_bytes
    if not _is_int(chunk) or not MIN_CHUNK_BYTES <= chunk <= MAX_CHUNK_BYTES or chunk % 8:
        return "max_chunk_bytes", (
            f"expected a multiple of 8 in {MIN_CHUNK_BYTES}..{MAX_CHUNK_BYTES}, got {chunk!r}"
        )
    if not isinstance(c.same_host_ipc, bool):
        return "same_host_ipc", f"expected true or false, got {c.same_host_ipc!r}"
    return None
