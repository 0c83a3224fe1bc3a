"""check_integrity() detects each kind of broken invariant (corrupted on purpose)."""

from __future__ import annotations

import pytest
from kv_factories import make_manager
from test_kvcache_support import run_prefill

from kvcache import KVCacheError, Level
from kvcache.block import CopyOp


def _manager():
    m = make_manager("cpu", primary_blocks=6, host_blocks=4)
    run_prefill(m, "a", list(range(8)))
    m.release("a")  # blocks 0 -> 1 cached
    run_prefill(m, "b", list(range(100, 112)))  # blocks 2, 3, 4 in use
    m.check_integrity()
    return m, m._by_window[64].bm


def _move_to_secondary(bm, b):
    """Swap b with the free secondary block holding slot 0 (keeps slots a permutation, owners right)."""
    spare = next(x for x in bm.free[Level.SECONDARY] if x.slot == 0)
    b.level, spare.level, b.slot, spare.slot = spare.level, b.level, spare.slot, b.slot
    bm.owners[b.level][b.slot], bm.owners[spare.level][spare.slot] = b, spare
    bm.free[Level.SECONDARY].remove(spare)
    bm.free[Level.PRIMARY].append(spare)


@pytest.mark.parametrize(("corrupt", "message"), [
    (lambda bm: setattr(bm.blocks[2], "ref", 2), "block 2 has ref=2 but 1 request references"),
    (lambda bm: setattr(bm.blocks[1], "slot", 0), "PRIMARY slots are not a permutation"),
    (lambda bm: _move_to_secondary(bm, bm.blocks[0]), "primary block 1 has a SECONDARY parent 0"),
    (lambda bm: bm.owners[Level.PRIMARY].reverse(), r"PRIMARY slot owners are stale"),
    (lambda bm: setattr(bm.blocks[0], "secondary_children", 1), "block 0 counts 1 secondary children, has 0"),
    (lambda bm: setattr(bm, "num_reclaimable", 5), "num_reclaimable=5 but 2"),
    (lambda bm: setattr(bm.blocks[1], "queue_seq", -1), r"eviction candidates \[1\] of the PRIMARY level"),
    (lambda bm: bm.copies.append(CopyOp(Level.PRIMARY, 0, Level.SECONDARY, 0)), "1 copies were never executed"),
    (lambda bm: setattr(bm.blocks[0], "holds", 1), "block 0 still has holds=1"),
    (lambda bm: bm.free[Level.PRIMARY].append(bm.blocks[1]), "block 1 is in 2 states"),
    (lambda bm: setattr(bm.blocks[0], "busy_children", 1), "block 0 counts 1 primary / 1 busy children"),
])
def test_check_integrity_reports_the_broken_invariant(corrupt, message):
    m, bm = _manager()
    corrupt(bm)
    with pytest.raises(KVCacheError, match=message):
        m.check_integrity()
