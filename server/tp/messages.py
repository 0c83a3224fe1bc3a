"""What rank 0 tells the other ranks of its server, and what they report back (msgspec, never pickle).

Rank 0 sends `Command`s, its operations on the shared state in the order it made them; applying them
in that order keeps every rank's pools identical in slot terms to rank 0's (a copy recorded before a
forward runs before it, a lease ends before its slots are written again, a pull starts after the
copies that freed its slots).
"""

from __future__ import annotations

import msgspec

from server.models.runner import SeqChunk


class Init(msgspec.Struct, tag=True, frozen=True):
    """First command: the slot counts of every window group's pools (rank 0's manager decided them)."""

    num_primary: int
    num_secondary: int
    num_disk: int = 0  # a disk tier: each rank keeps files of its own kv heads (kvcache/disk_mirror.py)


class DiskMeta(msgspec.Struct, array_like=True, frozen=True):
    """What the file of a disk slot rank 0 wrote says about its block (kvcache.disk_store.BlockMeta)."""

    slot: int
    block_hash: bytes
    parent_hash: bytes | None
    root_salt: bytes
    tokens: list[int]
    priority: int


class Copies(msgspec.Struct, tag=True, frozen=True):
    """Pool copies rank 0 ran on one window group, in order; `disk_meta`: the blocks its disk copies wrote."""

    window: int
    ops: list[tuple[int, int, int, int]]  # (src level, src slot, dst level, dst slot)
    disk_meta: list[DiskMeta] = []


class CheckDisk(msgspec.Struct, tag=True, frozen=True):
    """Read and check these disk files (window, disk slot, block hash) and stage their bytes for the
    copies that follow; answered by `DiskChecked` (rank 0 waits: it plans a disk hit in)."""

    call: int
    items: list[tuple[int, int, bytes]]


class Forward(msgspec.Struct, tag=True, frozen=True):
    """One step. With async scheduling, chunk `i` in `pending` takes its one token from row
    `pending[i]` of the previous step's sampled ids, which are on rank 0's device only: rank 0
    broadcasts those `num_sampled` ids (int64) right before the forward (server/tp/runner.py)."""

    seqs: list[SeqChunk]
    pending: dict[int, int] | None = None  # chunk index -> row of the sampled ids
    num_sampled: int = 0


class OfferLease(msgspec.Struct, tag=True, frozen=True):
    """Context side: serve pulls of lease `cid` from these primary slots (rank 0 pinned them)."""

    cid: str
    slots: dict[int, list[int]]  # window -> slot of each block, -1 released


class EndLease(msgspec.Struct, tag=True, frozen=True):
    """Context side: the lease ended on rank 0; its slots may be written again after this."""

    cid: str


class StartPull(msgspec.Struct, tag=True, frozen=True):
    """Generation side: pull this rank's kv heads of the request's missing blocks into these slots."""

    request_id: str
    ctx_endpoint: str
    ctx_epoch: str
    ctx_request_id: str
    wanted: dict[int, tuple[int, list[int]]]  # window -> (first block index, destination slots)
    stream: bool = False  # streamed KV: the context server is still prefilling (transceiver/sender/stream.py)


class CancelPull(msgspec.Struct, tag=True, frozen=True):
    """Generation side: the request's pull ended on rank 0 (failed, aborted); write nothing more."""

    request_id: str


class ShareLatent(msgspec.Struct, tag=True, frozen=True):
    """Generation side, a latent KV cache (multi-head latent attention): rank 0 pulled the request's
    latent alone (it is the same on every rank); take these slots' rows from it, which rank 0
    broadcasts right after sending this (`share_latent`)."""

    wanted: dict[int, tuple[int, list[int]]]  # window -> (first block index, slots), as StartPull's


class Stop(msgspec.Struct, tag=True, frozen=True):
    pass


Op = Init | Copies | CheckDisk | Forward | OfferLease | EndLease | StartPull | CancelPull | ShareLatent | Stop


class Command(msgspec.Struct, frozen=True):
    ops: list[Op]


class Joined(msgspec.Struct, tag=True, frozen=True):
    """A rank connected its channel end (rank 0 sends nothing to a rank before this arrives)."""

    rank: int


class Ready(msgspec.Struct, tag=True, frozen=True):
    """A rank loaded its shard and pools; a context rank's KV sender listens at `kv_endpoint`."""

    rank: int
    kv_endpoint: str | None = None


class PullDone(msgspec.Struct, tag=True, frozen=True):
    """A rank's part of a pull ended (`ok`, or failed with one of transceiver.wire.REASONS)."""

    rank: int
    request_id: str
    ok: bool
    reason: str | None = None
    error: str | None = None
    nbytes: int = 0


class DiskChecked(msgspec.Struct, tag=True, frozen=True):
    """A rank's answer to `CheckDisk` `call`: item index -> (reason, sentence) of the files it could not read."""

    rank: int
    call: int
    bad: dict[int, tuple[str, str]]


class Failure(msgspec.Struct, tag=True, frozen=True):
    """A rank hit an error it cannot recover from; it exits after this."""

    rank: int
    error: str


Report = Joined | Ready | PullDone | DiskChecked | Failure
