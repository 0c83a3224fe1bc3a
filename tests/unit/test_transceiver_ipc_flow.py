"""A whole same-GPU pull on CPU pools, in one process: the real KVSender and KVReceiver with real
KV cache managers, where only the CUDA boundary is replaced (the sender's export gives an offer
without handles, the receiver's open returns the sender's pool tensor itself, which is what a
CUDA IPC mapping is: the same memory). Checks the protocol around it: slots translated after
offload/onboard, every byte, the checksum, the lease released on Ack or on a failed copy, the knob,
and a sender that exported nothing refusing an IPC pull. The real handles: tests/gpu/test_transceiver_cuda.py."""

from __future__ import annotations

import pytest
import torch
import zmq
from kv_factories import make_manager
from waiting import wait_until

import transceiver.receiver.kv_receiver as receiver_mod
import transceiver.sender.kv_sender as sender_mod
from kvcache import KVCacheManager, Level
from transceiver.config import TransceiverConfig
from transceiver.link import shared_context
from transceiver.receiver import KVReceiver, PullResult
from transceiver.sender import KVSender
from transceiver.wire import Failed, IpcOffer, PeerIdentity, PullRequest, WindowRange, link_codec

TOKEN = "ipc-flow-token-0123456789"
W, TPB = 64, 4
CTX = PeerIdentity(hostname="h", boot_id="b", gpu_uuid="GPU-1", pid=1)
GEN = PeerIdentity(hostname="h", boot_id="b", gpu_uuid="GPU-1", pid=2)


def _kv(max_blocks: int, host_blocks: int = 0) -> KVCacheManager:
    # slot: 2 layers * 2 * 4 tpb * 2 heads * 8 * 4 B = 1 KiB
    return make_manager("cpu", tpb=TPB, primary_blocks=max_blocks, host_blocks=host_blocks, windows=(W, W),
                        max_seq_len=W, dim=8, secondary_offload_min_priority=0)


def _rows(kv: KVCacheManager) -> torch.Tensor:
    return kv.pool(W, Level.PRIMARY).view(kv.num_slots(W), -1).view(torch.int32)  # [slots, 256]


def _cache(kv: KVCacheManager, rid: str, tokens: list[int], lease: KVSender | None = None) -> int:
    """'Prefill' (block b of the prompt holds the value 1000 * tokens[b * TPB] + b everywhere)."""
    hit = kv.admit(rid, tokens)
    for b, slot in enumerate(kv.slot_table(rid, W)):
        if (b + 1) * TPB > hit:
            _rows(kv)[slot] = 1000 * tokens[b * TPB] + b
    kv.commit(rid, tokens, len(tokens))
    if lease is not None:
        lease.add_lease(rid, {W: kv.block_ids(rid, W)})
    kv.release(rid)
    return hit


@pytest.fixture
def same_gpu(monkeypatch):
    """The CUDA boundary of both sides, as in-process tensors; yields the sender's KV manager."""
    ctx_kv = _kv(max_blocks=8, host_blocks=16)
    monkeypatch.setattr(sender_mod, "ipc_identity", lambda pools, enabled: CTX if enabled else None)
    monkeypatch.setattr(sender_mod, "export_pools", lambda pools, identity: IpcOffer(identity=identity, pools=[]))
    monkeypatch.setattr(receiver_mod, "ipc_identity", lambda pools, enabled: GEN if enabled else None)
    monkeypatch.setattr(receiver_mod, "open_pools", lambda offer, own: {W: ctx_kv.pool(W, Level.PRIMARY)})
    return ctx_kv


def _leased(ctx_kv: KVCacheManager, sender: KVSender) -> tuple[list[int], list[int]]:
    """A 24-token request whose first 4 blocks were offloaded and onboarded: (tokens, block ids)."""
    warm = list(range(100, 116))
    _cache(ctx_kv, "warm", warm)
    _cache(ctx_kv, "filler", list(range(200, 232)))  # 8 blocks: warm goes to the host pool
    tokens = warm + list(range(300, 308))
    assert _cache(ctx_kv, "req", tokens, lease=sender) == 16  # reused from the host pool (onboarded)
    ids = sender._leases["req"].pinned[W]
    assert ids != ctx_kv.get_memory_pool_block_indices(ids, W) and ctx_kv.stats().onboards == 4
    return tokens, ids


def _step(sender: KVSender) -> None:
    sender.step()
    sender.wait(0.002)


def _run(sender: KVSender, rx: KVReceiver, timeout_s: float = 10.0) -> PullResult:
    def results() -> list[PullResult]:
        sender.step()
        return rx.step()

    return wait_until(results, timeout_s, "a pull result", step=lambda: rx.wait(0.002))[0]


def _pull(same_gpu: KVCacheManager, gen_ipc: bool = True):
    sender = KVSender(same_gpu, TransceiverConfig(auth_token=TOKEN), "fp")
    gen_kv = _kv(max_blocks=16)
    rx = KVReceiver(gen_kv, TransceiverConfig(auth_token=TOKEN, same_host_ipc=gen_ipc), "fp")
    tokens, ids = _leased(same_gpu, sender)
    gen_kv.admit("req", tokens)
    dst = gen_kv.slot_table("req", W)
    rx.start_pull("req", sender.endpoint, sender.epoch, "req", {W: (0, dst)})
    result = _run(sender, rx)
    wait_until(lambda: not sender.num_leases, 5, "the lease back", step=lambda: _step(sender))
    return sender, rx, result, [int(_rows(gen_kv)[s][0]) for s in dst], tokens


def test_ipc_pull_copies_every_block_from_translated_slots_and_ends_the_lease(same_gpu) -> None:
    sender, rx, result, values, tokens = _pull(same_gpu)
    try:
        assert (result.ok, result.nbytes) == (True, 6 * 1024), result.error
        assert values == [1000 * tokens[b * TPB] + b for b in range(6)]
        assert (sender.stats.ipc_transfers, rx.stats.ipc_transfers, rx.stats.bytes_received) == (1, 1, 6 * 1024)
        assert sender.ipc_exports == 1
        assert (sender.num_leases, sender.stats.transfers_ok, rx.stats.failures_by_reason) == (0, 1, {})
        same_gpu.check_integrity()
    finally:
        rx.close()
        sender.close()


def test_a_copy_that_does_not_match_the_checksum_fails_and_frees_the_lease(same_gpu, monkeypatch) -> None:
    shifted = lambda offer, own: {W: same_gpu.pool(W, Level.PRIMARY).roll(1, 0)}  # other bytes than checksummed
    monkeypatch.setattr(receiver_mod, "open_pools", shifted)
    sender, rx, result, _, _ = _pull(same_gpu)
    try:
        assert (result.ok, result.reason) == (False, "integrity")
        assert result.error.startswith("chunk checksum mismatch after the CUDA IPC copy (window 64, blocks 0..5)")
        assert (sender.num_leases, sender.stats.failures_by_reason) == (0, {"cancelled": 1})
        assert rx.stats.ipc_transfers == 0
    finally:
        rx.close()
        sender.close()


def test_same_host_ipc_false_on_the_receiver_uses_the_byte_path(same_gpu) -> None:
    sender, rx, result, values, tokens = _pull(same_gpu, gen_ipc=False)
    try:
        assert result.ok, result.error
        assert values == [1000 * tokens[b * TPB] + b for b in range(6)]
        assert (sender.stats.ipc_transfers, rx.stats.ipc_transfers, sender.num_leases) == (0, 0, 0)
        assert sender.ipc_exports == 0  # nobody asked: nothing exported
    finally:
        rx.close()
        sender.close()


def test_a_sender_that_exported_nothing_refuses_an_ipc_pull() -> None:
    kv = _kv(max_blocks=8)
    sender = KVSender(kv, TransceiverConfig(auth_token=TOKEN), "fp")  # CPU pools: nothing offered
    dealer = shared_context().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(sender.endpoint)
    try:
        _cache(kv, "req", list(range(8)), lease=sender)
        codec = link_codec(TOKEN.encode(), "gen", sender=False)
        dealer.send_multipart(codec.seal(PullRequest(pull_id=9, ctx_request_id="req", ctx_epoch=sender.epoch,
                                                     ranges=[WindowRange(window=W, first=0, count=2)],
                                                     via_ipc=True)))
        wait_until(lambda: dealer.poll(0), 5, "the sender's answer", step=lambda: _step(sender))
        assert (sender.ipc_identity, sender.ipc_exports) == (None, 0)
        assert codec.open(*dealer.recv_multipart())[1] == Failed(
            reason="bad_request", detail="the pull asks for CUDA IPC, which this context server never offered",
            pull_id=9)
        assert sender.num_leases == 1  # a refused pull leaves the lease for a correct one
    finally:
        dealer.close(linger=0)
        sender.close()
