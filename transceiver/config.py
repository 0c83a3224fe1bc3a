"""`cache_transceiver_config`: how one server's KV transceiver listens, authenticates and times out.
A msgspec Struct (types, ranges and unknown keys checked on conversion); no torch."""

from __future__ import annotations

from typing import Annotated

import msgspec

MIN_CHUNK_BYTES = 64 * 1024  # pyzmq copies frames below 64 KiB even with copy=False
MAX_CHUNK_BYTES = 1024 * 1024 * 1024
MIN_TOKEN_CHARS = 16
_TOKEN = f"null or a string of at least {MIN_TOKEN_CHARS} characters"
_ADDRESS = "an interface address such as 127.0.0.1"
_CHUNK = f"a multiple of 8 in {MIN_CHUNK_BYTES}..{MAX_CHUNK_BYTES}"


class TransceiverConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`auth_token` may be None in YAML only: the launcher generates one per deployment; a sender or
    receiver refuses to start without one."""

    kv_transfer_timeout_ms: Annotated[int, msgspec.Meta(gt=0)] = 60000
    auth_token: Annotated[str, msgspec.Meta(min_length=MIN_TOKEN_CHARS, description=_TOKEN)] | None = None
    # an interface address (a deployment's servers bind beside their HTTP address unless set)
    host: Annotated[str, msgspec.Meta(pattern=r"^\S+$", description=_ADDRESS)] = "127.0.0.1"
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0  # 0: ephemeral, advertised via `KVSender.endpoint`
    # payload bytes per chunk message (and per frame)
    max_chunk_bytes: Annotated[int, msgspec.Meta(ge=MIN_CHUNK_BYTES, le=MAX_CHUNK_BYTES, multiple_of=8,
                                                 description=_CHUNK)] = 8 << 20
    same_host_ipc: bool = True  # CUDA pools on one GPU: copy device-to-device via CUDA IPC (false: bytes)
    # Test only (never in production): the byte path paces chunks as a link of this latency per message
    # and bandwidth would (0: off), so CPU tests show a transfer overlapping the prefill (`Pacer`).
    test_link_delay_ms: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    test_link_bytes_per_s: Annotated[int, msgspec.Meta(ge=0)] = 0

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
