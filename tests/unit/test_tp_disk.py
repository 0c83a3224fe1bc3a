"""A tensor-parallel server's disk tier, in one process: rank 0's manager keeps the books and its
files; "rank 1" is a manager with the same slot counts whose pools hold other bytes (its own kv
heads) and whose files are its own (kvcache/disk_mirror.py), fed exactly what server/tp sends it:
rank 0's copies with the blocks its disk writes named (server/tp/disk.py `disk_metas`), and a check
of its own files before rank 0 plans a disk hit in.

Blocks go primary -> host -> disk and back up on both "ranks", each with its own bytes; a file
rank 1 lost makes rank 0 drop the block (the prompt is computed again), never serve it half.
tpb 4, one window group (64), the same pools as tests/unit/test_kvcache_disk.py.
"""

from __future__ import annotations

import pytest
import torch
from kv_factories import make_manager
from test_kvcache_disk import KEY, A, B, C, D, E, written
from test_kvcache_support import assert_request_kv, run_prefill
from waiting import wait_until

from kvcache import Level
from kvcache.config import DiskTierConfig
from server.tp.disk import block_metas, disk_metas

W = 64


class TwoRanks:
    def __init__(self, tmp_path) -> None:
        kw = {"primary_blocks": 2, "host_blocks": 2, "secondary_offload_min_priority": 0}
        self.rank0 = make_manager("cpu", disk_blocks=3, disk_dir=str(tmp_path / "kv"), disk_key=KEY, salt="fp", **kw)
        self.rank1 = make_manager("cpu", salt="fp", **kw)  # its books stay empty: rank 0 keeps them
        tier = self.rank0.config.disk
        assert isinstance(tier, DiskTierConfig)
        self.disk1 = self.rank1.mirror_disk(tier.for_rank(1), KEY, self.rank0.num_slots(W, Level.DISK))
        self.rank0.observe_copies(self._mirror)
        self.rank0.share_disk_checks(self._check)

    def _mirror(self, window: int, ops) -> None:
        self.disk1.before_copies(window, block_metas(disk_metas(self.rank0, window, ops)))
        self.rank1.apply_copies(window, ops)
        self.disk1.after_copies(window)

    def _check(self, items):
        """Rank 1 reads its files (at once here; over the rank channel, while rank 0 reads its own)."""
        bad = self.disk1.check(items)
        return lambda: bad

    def prefill(self, rid: str, tokens: list[int]) -> int:
        """Both ranks compute the uncached positions: rank 1's bytes are rank 0's, negated."""
        hit = run_prefill(self.rank0, rid, tokens)
        for slot in self.rank0.slot_table(rid, W):
            self.rank1.pool(W)[slot] = -self.rank0.pool(W)[slot]
        return hit

    def close(self) -> None:
        self.rank0.close()
        self.disk1.close()


@pytest.fixture
def ranks(tmp_path):
    made = TwoRanks(tmp_path)
    yield made
    made.close()


def push_a_to_disk(ranks: TwoRanks) -> None:
    for rid, tokens in zip("abcde", (A, B, C, D, E), strict=True):
        ranks.prefill(rid, tokens)
        ranks.rank0.release(rid)
    written(ranks.rank0)
    wait_until(lambda: not ranks.disk1.store._pending, 10, what="rank 1's queued writes to land")


def test_each_rank_brings_its_own_bytes_back_from_its_own_files(ranks, tmp_path):
    push_a_to_disk(ranks)
    assert ranks.rank0.stats().disk_offloads == 1
    assert (tmp_path / "kv" / "w64" / "0.kv").exists() and (tmp_path / "kv.rank1" / "w64" / "0.kv").exists()
    assert ranks.prefill("a2", A + [9]) == 4  # a's block came up from disk on both ranks
    assert ranks.rank0.stats().disk_onboards == 1
    assert_request_kv(ranks.rank0, "a2", A, 4)
    slot = ranks.rank0.slot_table("a2", W)[0]
    assert torch.equal(ranks.rank1.pool(W)[slot], -ranks.rank0.pool(W)[slot])
    assert ranks.rank1.pool(W)[slot].abs().sum() > 0


@pytest.mark.parametrize(("damage", "reason"), [
    (lambda p: p.unlink(), "missing"),
    (lambda p: p.write_bytes(p.read_bytes()[:-1] + bytes([p.read_bytes()[-1] ^ 1])), "corrupt"),
])
def test_a_file_rank_1_lost_drops_the_block_on_rank_0(ranks, tmp_path, damage, reason):
    push_a_to_disk(ranks)
    damage(tmp_path / "kv.rank1" / "w64" / "0.kv")
    assert ranks.prefill("a2", A + [9]) == 0  # computed again, not served half
    assert ranks.rank0.stats().disk_dropped == {reason: 1}
    assert ranks.rank0.stats().disk_onboards == 0
    ranks.rank0.check_integrity()


def test_a_rank_without_books_cannot_take_a_disk_tier_of_its_own(ranks):
    with pytest.raises(Exception, match="cannot mirror"):
        ranks.rank0.mirror_disk(ranks.rank0.config.disk, KEY, 3)


def test_disk_paths_per_rank():
    tier = DiskTierConfig(path="/var/cache/kv", max_bytes=1)
    assert [tier.for_rank(r).path for r in range(3)] == ["/var/cache/kv", "/var/cache/kv.rank1", "/var/cache/kv.rank2"]
