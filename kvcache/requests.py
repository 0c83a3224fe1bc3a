"""Per-request state kept by the KV cache manager (one entry per live request)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvcache.block import Block


@dataclass
class RequestState:
    request_id: str
    salt_digest: bytes  # hashing namespace of this request (manager salt + request salt)
    priority: int  # retention priority given to the blocks it uses
    blocks: list[list[Block | None]]  # per window group, in token order; None where released
    hashes: list[bytes] = field(default_factory=list)  # chained hashes of its full blocks so far
    committed: list[int] = field(default_factory=list)  # per group: leading blocks commit has handled
    commit_stopped: list[bool] = field(default_factory=list)  # per group: chain broken, commit no more
    released_upto: list[int] = field(default_factory=list)  # per group: blocks before it are released
