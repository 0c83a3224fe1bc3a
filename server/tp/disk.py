"""A tensor-parallel server's disk tier: every rank keeps files of its own kv heads.

The other ranks get the disk metadata of rank 0's host -> disk copies, in order, and a `CheckDisk`
before a disk hit; rank 0 waits for every `DiskChecked` and drops each block a rank could not read."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from kvcache import KVCacheManager, Level
from kvcache.block import CopyOp
from kvcache.disk_store import BlockMeta
from server.tp.messages import CheckDisk, DiskChecked, DiskMeta, Op, Report


class Channel(Protocol):
    """What of rank 0's `server.tp.ranks.Ranks` the checks use."""

    size: int

    def flush(self, *ops: Op) -> None: ...

    def collect(self, wanted: Callable[[Report], bool], timeout_s: float) -> dict[int, Report]: ...

ANSWER_MARGIN_S = 10.0  # beyond the disk's io_timeout_s: a rank that has not answered by then is stuck


def disk_metas(kv: KVCacheManager, window: int, ops: list[CopyOp]) -> list[DiskMeta]:
    """The blocks rank 0's host -> disk copies of `ops` wrote (call it right after they ran)."""
    out = []
    for op in ops:
        if op.dst_level is Level.DISK and (meta := kv.disk_block_meta(window, op.dst_slot)) is not None:
            out.append(DiskMeta(op.dst_slot, meta.block_hash, meta.parent_hash, meta.root_salt, list(meta.tokens),
                                meta.priority))
    return out


def block_metas(metas: list[DiskMeta]) -> dict[int, BlockMeta]:
    """Disk slot -> the block its file must name (a rank's side of `disk_metas`)."""
    return {m.slot: BlockMeta(m.block_hash, m.parent_hash, m.root_salt, tuple(m.tokens), m.priority) for m in metas}


class DiskChecks:
    """Rank 0's `kvcache.disk_tier.PeerCheck`: every other rank reads the same files of its own."""

    def __init__(self, ranks: Channel, io_timeout_s: float) -> None:
        self._ranks = ranks
        self._timeout_s = io_timeout_s + ANSWER_MARGIN_S
        self._calls = 0

    def __call__(self, items: list[tuple[int, int, bytes]]) -> Callable[[], dict[int, tuple[str, str]]]:
        self._calls += 1
        call = self._calls
        self._ranks.flush(CheckDisk(call, items))
        return lambda: self._answers(call, len(items))

    def _answers(self, call: int, n: int) -> dict[int, tuple[str, str]]:
        answers = self._ranks.collect(lambda r: isinstance(r, DiskChecked) and r.call == call, self._timeout_s)
        bad: dict[int, tuple[str, str]] = {}
        for rank in range(1, self._ranks.size):
            answer = answers.get(rank)
            if answer is None:
                bad.update({i: ("timeout", f"rank {rank} did not check its file in time") for i in range(n)})
                continue
            assert isinstance(answer, DiskChecked)
            for i, (reason, detail) in answer.bad.items():
                bad.setdefault(i, (reason, f"rank {rank}: {detail}"))
        return bad
