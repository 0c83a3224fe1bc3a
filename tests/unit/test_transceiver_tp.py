"""KV between tensor-parallel ranks, in-process with real senders, receivers and KV managers.

A "server" of N ranks is N managers whose pools hold a share of the model's 4 kv heads each (the
same slot counts); rank 0's manager keeps the books. Context TP=2 -> generation TP=1 merges both
context ranks' heads into each block, TP=1 -> TP=2 splits one sender's blocks between two
receivers; in both, every byte must land where the generation side's heads say, the parts keep the
lease until the generation side's Release, and the lease then ends with its blocks unpinned.
"""

from __future__ import annotations

import time

import pytest
import torch
from kv_factories import make_manager
from waiting import wait_until

from kvcache import KVCacheManager, Level
from transceiver.config import TransceiverConfig
from transceiver.receiver import KVReceiver, PullResult
from transceiver.sender import KVSender
from transceiver.sender.rank_sender import RankSender
from transceiver.tp import gather_heads, plan_parts, scatter_heads
from transceiver.wire import Layout, RankEndpoint, WindowLayout, layout_mismatch

TOKEN = "unit-tp-transfer-token-0123"
HEADS, TPB, W = 4, 4, 64
CONFIG = TransceiverConfig(auth_token=TOKEN, max_chunk_bytes=64 * 1024)


def _kv(heads: int) -> KVCacheManager:
    return make_manager("cpu", tpb=TPB, primary_blocks=W // TPB, windows=(W, W), max_seq_len=W, heads=heads, dim=8,
                        dtype=torch.bfloat16)


def _bits(kv: KVCacheManager, slots: list[int]) -> torch.Tensor:
    """The blocks in `slots` as raw 16-bit words (random bits include NaNs): [n, layers, 2, tpb, heads, dim]."""
    return kv.pool(W, Level.PRIMARY)[slots].view(torch.int16)


def _whole(kvs: list[KVCacheManager], slots: list[int]) -> torch.Tensor:
    """The blocks in `slots` with every rank's heads put back together."""
    return torch.cat([_bits(kv, slots) for kv in kvs], dim=4)


def _pull(receivers: list[KVReceiver], senders: list, request: str) -> list[PullResult]:
    def step() -> None:
        for s in senders:
            s.step()

    results: list[PullResult] = []
    wait_until(lambda: len(results) == len(receivers), 20, "every rank's share",
               step=lambda: (step(), [results.extend(r.step()) for r in receivers]))
    assert all(r.ok and r.request_id == request for r in results), results
    return results


def _prefilled(kv: KVCacheManager, seed: int) -> list[int]:
    kv.admit("ctx", list(range(10)))  # 3 blocks
    kv.pool(W, Level.PRIMARY).view(torch.int16).random_(generator=torch.Generator().manual_seed(seed))
    return kv.block_ids("ctx", W)


def test_two_context_ranks_into_one_generation_rank() -> None:
    ctx0, ctx1, gen = _kv(2), _kv(2), _kv(HEADS)
    ids = _prefilled(ctx0, 1)
    _prefilled(ctx1, 2)  # the same bookkeeping: its slots are rank 0's
    rank1 = RankSender(ctx1, CONFIG, "fp", "ctx-epoch", (2, HEADS))
    sender = KVSender(ctx0, CONFIG, "fp", epoch="ctx-epoch", kv_heads=(0, HEADS),
                      other_ranks=[RankEndpoint(rank1.endpoint, (2, 4))])
    receiver = KVReceiver(gen, CONFIG, "fp")
    try:
        sender.add_lease("cid", {W: ids})
        slots = ctx0.slot_table("ctx", W)
        rank1.offer("cid", {W: slots})
        gen.admit("g", list(range(10)))
        dst = gen.slot_table("g", W)
        receiver.start_pull("g", sender.endpoint, "ctx-epoch", "cid", {W: (0, dst)})
        _pull([receiver], [sender, rank1], "g")
        assert torch.equal(_bits(gen, dst), _whole([ctx0, ctx1], slots))
        # each rank counts its share once the receiver's Release reaches it: step both until then
        wait_until(lambda: sender.num_leases == 0 and rank1.stats.transfers_ok == 1, 10,
                   "the Release ended the lease on both ranks", step=lambda: (sender.step(), rank1.step()))
        assert ctx0.num_pins(W) == 0 and sender.stats.transfers_ok == 1
    finally:
        for link in (receiver, sender, rank1):
            link.close()


def test_one_context_rank_into_two_generation_ranks() -> None:
    ctx, gen0, gen1 = _kv(HEADS), _kv(2), _kv(2)
    ids = _prefilled(ctx, 3)
    sender = KVSender(ctx, CONFIG, "fp")
    receivers = [KVReceiver(gen0, CONFIG, "fp", kv_heads=(0, HEADS), releases=False),
                 KVReceiver(gen1, CONFIG, "fp", kv_heads=(2, HEADS), releases=False)]
    try:
        sender.add_lease("cid", {W: ids})
        slots = ctx.slot_table("ctx", W)
        gen0.admit("g", list(range(10)))
        dst = gen0.slot_table("g", W)
        for r in receivers:
            r.start_pull("g", sender.endpoint, sender.epoch, "cid", {W: (0, dst)})
        _pull(receivers, [sender], "g")
        source = _bits(ctx, slots)
        assert torch.equal(_bits(gen0, dst), source[:, :, :, :, :2])
        assert torch.equal(_bits(gen1, dst), source[:, :, :, :, 2:])
        for _ in range(20):  # the parts' Acks do not end the lease
            sender.step()
        assert sender.num_leases == 1 and ctx.num_pins(W) == 3
        receivers[0].release_lease(sender.endpoint, "cid", sender.epoch)
        # both parts' Acks are counted, and the Release ended the lease (they may arrive in either order)
        wait_until(lambda: sender.num_leases == 0 and sender.stats.transfers_ok == 2, 10,
                   "the Release ended the lease", step=sender.step)
        assert ctx.num_pins(W) == 0
    finally:
        for link in (*receivers, sender):
            link.close()


@pytest.mark.parametrize(("ranks", "mine", "parts"), [
    ([((0, 4), "a")], (0, 4), [("a", None, None)]),  # one rank each: whole slots
    ([((0, 2), "a"), ((2, 4), "b")], (2, 4), [("b", None, None)]),  # the same heads: one to one
    ([((0, 2), "a"), ((2, 4), "b")], (0, 4), [("a", (0, 2), (0, 2)), ("b", (0, 2), (2, 4))]),  # merge
    ([((0, 4), "a")], (2, 4), [("a", (2, 4), (0, 2))]),  # split
    ([((0, 1), "a"), ((0, 1), "a2"), ((1, 2), "b"), ((1, 2), "b2")], (0, 2),  # replicated: the first holder
     [("a", (0, 1), (0, 1)), ("b", (0, 1), (1, 2))]),
])
def test_plan_parts(ranks, mine, parts) -> None:
    planned = plan_parts([RankEndpoint(e, h) for h, e in ranks], mine)
    assert [(p.endpoint, p.src, p.dst) for p in planned] == parts


def test_plan_parts_refuses_heads_no_rank_holds() -> None:
    with pytest.raises(ValueError, match="no context rank holds kv head 2"):
        plan_parts([RankEndpoint("a", (0, 2))], (0, 4))


def test_gather_then_scatter_heads_moves_exactly_those_heads() -> None:
    pool = torch.randn(6, 2, 2, TPB, HEADS, 8).to(torch.bfloat16)
    out = torch.empty(1 << 16, dtype=torch.uint8)
    n = gather_heads(pool, [4, 1], (1, 3), out)
    dst = torch.zeros(6, 2, 2, TPB, 2, 8, dtype=torch.bfloat16)
    scatter_heads(dst, [0, 5], (0, 2), [out[: n // 2].numpy(), out[n // 2 : n].numpy()])  # two frames
    assert torch.equal(dst[0], pool[4, :, :, :, 1:3]) and torch.equal(dst[5], pool[1, :, :, :, 1:3])
    assert dst[1:5].abs().sum() == 0


def _layout(heads: int, start: int = 0, total: int = 0) -> Layout:
    return Layout(tokens_per_block=TPB, fingerprint="fp", kv_heads_total=total, kv_head_start=start,
                  windows=[WindowLayout(window=W, layers=[0, 1], kv_heads=heads, head_dim=8, dtype="bfloat16",
                                        slot_bytes=2 * 2 * TPB * heads * 8 * 2)])


def test_layouts_of_ranks_with_different_head_shares_are_compatible() -> None:
    assert layout_mismatch(_layout(2, 2, HEADS), _layout(HEADS)) is None
    assert layout_mismatch(_layout(1, 0, HEADS), _layout(2, 2, HEADS)) is None
    skewed = layout_mismatch(_layout(2, 0, 2), _layout(HEADS))
    assert skewed == "the model's kv_heads differs: context 2 vs generation 4"
    bad = Layout(tokens_per_block=TPB, fingerprint="fp", kv_heads_total=HEADS,
                 windows=[WindowLayout(window=W, layers=[0, 1], kv_heads=2, head_dim=8, dtype="bfloat16",
                                       slot_bytes=999)])
    assert layout_mismatch(bad, _layout(HEADS)).startswith("window 64: bytes per kv head differ")


def test_a_rank_serves_a_pull_that_came_before_its_offer() -> None:
    ctx0, ctx1, gen = _kv(2), _kv(2), _kv(2)
    _prefilled(ctx1, 4)
    slots = ctx1.slot_table("ctx", W)
    rank1 = RankSender(ctx1, CONFIG, "fp", "ctx-epoch", (2, HEADS))
    rank0 = KVSender(ctx0, CONFIG, "fp", epoch="ctx-epoch", kv_heads=(0, HEADS),
                     other_ranks=[RankEndpoint(rank1.endpoint, (2, 4))])
    receiver = KVReceiver(gen, CONFIG, "fp", kv_heads=(2, HEADS), releases=False)  # rank 1 of a TP=2 server
    try:
        rank0.add_lease("cid", {W: _prefilled(ctx0, 5)})
        gen.admit("g", list(range(10)))
        dst = gen.slot_table("g", W)
        receiver.start_pull("g", rank0.endpoint, "ctx-epoch", "cid", {W: (0, dst)})
        deadline = time.monotonic() + 0.5  # the part reaches rank 1, which has no offer: it waits
        while time.monotonic() < deadline:
            assert receiver.step() == []
            receiver.wait(0.02)
        assert receiver.num_pulls == 1 and receiver.stats.bytes_received == 0
        rank1.offer("cid", {W: slots})  # rank 0's command reaches rank 1 only now
        _pull([receiver], [rank0, rank1], "g")
        assert torch.equal(_bits(gen, dst), _bits(ctx1, slots))
        rank1.end("cid")  # rank 0's lease ends: rank 1 stops serving it
        assert not rank1.busy
    finally:
        for link in (receiver, rank0, rank1):
            link.close()


def test_generation_ranks_holding_the_same_kv_head_pull_it_at_once() -> None:
    """Generation TP=4 over 2 kv heads: ranks 0 and 1 both hold head 0 (replicated); each is a part
    of its own receiver, so the sender serves both at once (a second part of one receiver would not)."""
    ctx = _kv(2)
    ids = _prefilled(ctx, 6)
    sender = KVSender(ctx, CONFIG, "fp")
    gens = [_kv(1) for _ in range(3)]
    receivers = [KVReceiver(g, CONFIG, "fp", kv_heads=(h, 2), releases=False)
                 for g, h in zip(gens, (0, 0, 1), strict=True)]
    try:
        sender.add_lease("cid", {W: ids})
        slots = ctx.slot_table("ctx", W)
        gens[0].admit("g", list(range(10)))
        dst = gens[0].slot_table("g", W)
        for r in receivers:
            r.start_pull("g", sender.endpoint, sender.epoch, "cid", {W: (0, dst)})
        _pull(receivers, [sender], "g")
        source = _bits(ctx, slots)
        for g, head in zip(gens, (0, 0, 1), strict=True):
            assert torch.equal(_bits(g, dst), source[:, :, :, :, head:head + 1])
        receivers[0].release_lease(sender.endpoint, "cid", sender.epoch)
        wait_until(lambda: sender.num_leases == 0, 10, "the Release ended the lease", step=sender.step)
    finally:
        for link in (*receivers, sender):
            link.close()
