"""Random sequences of admit / decode / release / early release / pin / unpin / ensure_primary under
eviction pressure, with offload on and off (to the host, and on to a disk tier) and VSWA on and off
(hypothesis stateful testing).

After every step: check_integrity(), every cached block (any level) holds the bytes of its token
prefix, and every live request's computed positions hold the right KV. OutOfBlocksError must leave
the state exactly as it was."""

from __future__ import annotations

import dataclasses
import shutil
import tempfile

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from kv_factories import make_manager
from test_kvcache_support import DEVICES, PrefixBook, assert_request_kv, tree_locations, write_kv

from kvcache import OutOfBlocksError

TPB = 4
PREFIXES = [[], [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 9], [7] * 9, [1, 2, 3, 4, 5, 6, 7, 8, 10, 11]]


class CacheMachine(RuleBasedStateMachine):
    device = "cpu"
    host_blocks = 0
    disk_blocks = 0
    windows: tuple[int, ...] = (64,)
    copy = True

    def __init__(self) -> None:
        super().__init__()
        self.disk_dir = tempfile.mkdtemp(prefix="kv-disk-") if self.disk_blocks else None
        self.m = make_manager(self.device, tpb=TPB, primary_blocks=7, host_blocks=self.host_blocks,
                              windows=self.windows, copy_on_partial_reuse=self.copy,
                              disk_blocks=self.disk_blocks, disk_dir=self.disk_dir, disk_key=b"k" * 32,
                              secondary_offload_min_priority=0 if self.disk_blocks else 35)
        self.book = PrefixBook(TPB)
        self.live: dict[str, list[int]] = {}  # request -> tokens (all computed)
        self.pins: list[tuple[int, list[int]]] = []
        self.next_id = 0

    def _snapshot(self):
        m = self.m
        stats = dataclasses.replace(m.stats(), disk_bytes_written=0, disk_queued_bytes=0)  # the writers' pace
        return (stats, {w: m.cached_block_hashes(w) for w in m.window_sizes},
                {rid: [m.block_ids(rid, w) for w in m.window_sizes] for rid in self.live},
                {w: sorted(tree_locations(m, w).values()) for w in m.window_sizes})

    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(0, 3), max_size=9),
          extra=st.integers(0, 3), priority=st.sampled_from([10, 35, 80]))
    def admit(self, prefix, tail, extra, priority):
        tokens = prefix + tail
        if not tokens:
            return
        rid = f"r{self.next_id}"
        self.next_id += 1
        before = self._snapshot()
        try:
            hit = self.m.admit(rid, tokens, num_tokens=len(tokens) + extra, priority=priority)
        except OutOfBlocksError:
            assert self._snapshot() == before
            return
        assert 0 <= hit < len(tokens)
        assert_request_kv(self.m, rid, tokens, hit)  # reused KV is the right KV
        write_kv(self.m, rid, tokens, hit, len(tokens))
        self.m.commit(rid, tokens, len(tokens))
        self.book.add(tokens)
        self.live[rid] = tokens

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(0, 3))
    def decode(self, data, token):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        tokens = self.live[rid] + [token]
        if len(tokens) > 64:
            return
        before = self._snapshot()
        try:
            self.m.extend(rid, len(tokens))
        except OutOfBlocksError:
            assert self._snapshot() == before
            return
        write_kv(self.m, rid, tokens, len(tokens) - 1, len(tokens))
        self.m.commit(rid, tokens, len(tokens))
        self.book.add(tokens)
        self.live[rid] = tokens

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def release(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        self.m.release(rid)
        del self.live[rid]

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def release_out_of_window(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        self.m.release_out_of_window(rid, len(self.live[rid]))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def pin_request_blocks(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        w = data.draw(st.sampled_from(self.m.window_sizes))
        ids = [i for i in self.m.block_ids(rid, w) if i >= 0]
        self.m.pin_blocks(ids, w)  # live blocks are primary: never fails
        self.pins.append((w, ids))

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data):
        w, ids = self.pins.pop(data.draw(st.integers(0, len(self.pins) - 1)))
        self.m.unpin_blocks(ids, w)

    @rule(data=st.data())
    def ensure_primary_of_cached(self, data):
        w = data.draw(st.sampled_from(self.m.window_sizes))
        bm = self.m._by_window[w].bm
        cached = sorted(b.id for b in bm.tree.by_hash.values())
        if not cached:
            return
        ids = data.draw(st.lists(st.sampled_from(cached), min_size=1, max_size=3))
        before = self._snapshot()
        try:
            self.m.ensure_primary(ids, w)
        except OutOfBlocksError:
            assert self._snapshot() == before
            return
        assert len(self.m.get_memory_pool_block_indices(ids, w)) == len(ids)

    @invariant()
    def consistent(self):
        m = self.m
        m.check_integrity()
        self.book.assert_cached_blocks(m)
        for rid, tokens in self.live.items():
            assert_request_kv(m, rid, tokens, len(tokens))
            for w in m.window_sizes:
                assert m.get_memory_pool_block_indices(m.block_ids(rid, w), w) == m.slot_table(rid, w)

    def teardown(self):
        for rid in list(self.live):
            self.m.release(rid)
        for w, ids in self.pins:
            self.m.unpin_blocks(ids, w)
        self.m.check_integrity()
        in_use = {key: n for key, n in self.m.stats().blocks.items() if key[2] == "in_use"}
        assert set(in_use.values()) == {0}  # after all requests end and pins go, used == 0
        self.m.close()
        if self.disk_dir is not None:
            shutil.rmtree(self.disk_dir)


VARIANTS = {  # (host blocks, disk blocks, windows, copy_on_partial_reuse)
    "plain": (0, 0, (64,), True),
    "offload": (4, 0, (64,), False),
    "vswa": (0, 0, (8, 64, 8), False),
    "vswa_offload": (4, 0, (8, 64), True),
    "disk": (1, 6, (64,), True),  # every evicted block goes down (secondary_offload_min_priority 0)
    "vswa_disk": (1, 4, (8, 64), False),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_random_operation_sequences(device, variant):
    host, disk, windows, copy = VARIANTS[variant]
    machine = type(f"Machine_{variant}", (CacheMachine,), {"device": device, "host_blocks": host,
                                                           "disk_blocks": disk, "windows": windows, "copy": copy})
    run_state_machine_as_test(machine, settings=settings(
        max_examples=100, stateful_step_count=40, deadline=None, database=None,
        suppress_health_check=list(HealthCheck)))
