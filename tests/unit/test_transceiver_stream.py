"""Streamed leases (transceiver/sender/stream.py) with the real KVSender and KVReceiver and real KV
cache managers in one process: a pull that starts before its lease is offered gets each block once
the "prefill" has written it, its Done brings the first token; cancelling mid-stream, or dropping
a request whose lease never opened, leaves no pin behind; the same-GPU path sends batches; the
test-only link pacing holds chunks back."""

from __future__ import annotations

import time

import pytest
import torch
from kv_factories import make_manager
from waiting import wait_until

import transceiver.receiver.kv_receiver as receiver_mod
import transceiver.sender.kv_sender as sender_mod
from kvcache import KVCacheManager, Level
from transceiver.config import TransceiverConfig
from transceiver.receiver import KVReceiver, PullResult
from transceiver.sender import KVSender
from transceiver.wire import IpcOffer, PeerIdentity

TOKEN = "stream-test-token-0123456789"
W, TPB, SLOT = 64, 4, 1024
TOKENS = list(range(300, 324))  # 6 blocks
CTX = PeerIdentity(hostname="h", boot_id="b", gpu_uuid="GPU-1", pid=1)
GEN = PeerIdentity(hostname="h", boot_id="b", gpu_uuid="GPU-1", pid=2)


def _kv(max_blocks: int = 16) -> KVCacheManager:
    # slot: 2 layers * 2 * 4 tpb * 2 heads * 8 * 4 B = 1 KiB
    return make_manager("cpu", tpb=TPB, primary_blocks=max_blocks, windows=(W, W), max_seq_len=W, dim=8)


def _rows(kv: KVCacheManager) -> torch.Tensor:
    return kv.pool(W, Level.PRIMARY).view(kv.num_slots(W), -1).view(torch.int32)  # [slots, 256]


class Pair:
    """A context request being 'prefilled' on `ctx`, and its generation request on `gen`."""

    def __init__(self, **config) -> None:
        self.ctx, self.gen = _kv(), _kv()
        self.sender = KVSender(self.ctx, TransceiverConfig(auth_token=TOKEN, **config), "fp")
        self.rx = KVReceiver(self.gen, TransceiverConfig(auth_token=TOKEN, **config), "fp")
        self.ctx.admit("req", TOKENS)
        self.gen.admit("req", TOKENS)
        self.dst = self.gen.slot_table("req", W)

    def pull(self) -> None:
        self.rx.start_pull("req", self.sender.endpoint, self.sender.epoch, "req", {W: (0, self.dst)}, stream=True)

    def prefill(self, first: int, count: int, **final) -> bool:
        """Write blocks [first, first + count) and offer them."""
        ids = self.ctx.block_ids("req", W)[first:first + count]
        for b in range(first, first + count):
            _rows(self.ctx)[self.ctx.slot_table("req", W)[b]] = 1000 + b
        return self.sender.extend_stream("req", {W: (first, ids)}, **final)

    def written(self) -> list[int]:
        return [int(_rows(self.gen)[s][0]) for s in self.dst]

    def run(self, timeout_s: float = 10.0) -> PullResult:
        def results() -> list[PullResult]:
            self.sender.step()
            return self.rx.step()

        return wait_until(results, timeout_s, "a pull result", step=lambda: self.rx.wait(0.002))[0]

    def settle(self) -> None:
        def step() -> None:
            self.sender.step()
            self.rx.step()
            self.sender.wait(0.002)

        wait_until(lambda: not self.sender.num_leases, 5, "the lease back", step=step)

    def close(self) -> None:
        self.rx.close()
        self.sender.close()


@pytest.fixture
def pair():
    p = Pair()
    yield p
    p.close()


def _until_written(pair: Pair, blocks: int) -> None:
    def step() -> None:
        pair.sender.step()
        assert not pair.rx.step()  # no result before the final extension
        pair.rx.wait(0.002)

    wait_until(lambda: pair.written()[:blocks] == [1000 + b for b in range(blocks)], 10,
               f"blocks 0..{blocks - 1} on the generation side", step=step)


def test_a_streamed_pull_gets_each_block_as_it_is_written_and_the_first_token_with_done(pair) -> None:
    pair.pull()  # before the lease exists: the sender holds it
    time.sleep(0.05)
    pair.sender.open_stream("req", {W: 6})
    assert pair.prefill(0, 2)
    _until_written(pair, 2)
    assert pair.written()[2:] == [0, 0, 0, 0]  # not written on the context side yet: not sent
    assert pair.prefill(2, 3)
    _until_written(pair, 5)
    assert pair.prefill(5, 1, final=True, first_tokens=(77,), cached_tokens=8)
    result = pair.run()
    assert (result.ok, result.first_tokens, result.cached_tokens, result.nbytes) == (True, (77,), 8, 6 * SLOT)
    assert pair.written() == [1000 + b for b in range(6)]
    pair.settle()
    assert (pair.sender.stats.transfers_ok, pair.sender.pinned_blocks()) == (1, {})
    pair.ctx.check_integrity()
    pair.gen.check_integrity()


def test_a_pull_started_after_part_of_the_prompt_was_written_catches_up(pair) -> None:
    pair.sender.open_stream("req", {W: 6})
    assert pair.prefill(0, 4)
    pair.pull()
    _until_written(pair, 4)
    assert pair.prefill(4, 2, final=True, first_tokens=(5, 6))
    result = pair.run()
    assert (result.ok, result.first_tokens) == (True, (5, 6))
    pair.settle()


def test_cancel_mid_stream_ends_the_lease_and_unpins_every_block(pair) -> None:
    pair.sender.open_stream("req", {W: 6})
    pair.pull()
    assert pair.prefill(0, 3)
    _until_written(pair, 3)
    assert pair.rx.cancel("req")
    pair.settle()
    assert pair.sender.stats.failures_by_reason == {"cancelled": 1}
    assert not pair.prefill(3, 3, final=True, first_tokens=(1,))  # the lease is gone: nothing pinned
    assert pair.sender.pinned_blocks() == {}
    pair.ctx.release("req")
    pair.ctx.check_integrity()


def test_a_waiting_pull_fails_when_the_request_is_dropped_before_its_lease_opened(pair) -> None:
    pair.pull()
    time.sleep(0.05)
    pair.sender.drop_lease("req")  # aborted while queued on the context server
    result = pair.run()
    assert (result.ok, result.reason) == (False, "cancelled")
    assert pair.sender.num_leases == 0


def test_a_streamed_lease_that_ends_without_its_first_token_fails_the_pull(pair) -> None:
    pair.sender.open_stream("req", {W: 6})
    pair.pull()
    assert pair.prefill(0, 6, final=True)
    result = pair.run()
    assert (result.ok, result.reason) == (False, "integrity")
    assert "without the first token" in result.error
    pair.settle()


def test_the_test_link_pacing_holds_chunks_back() -> None:
    pair = Pair(test_link_bytes_per_s=16 * SLOT, max_chunk_bytes=64 * 1024)
    try:
        pair.sender.open_stream("req", {W: 6})
        pair.pull()
        start = time.monotonic()
        assert pair.prefill(0, 6, final=True, first_tokens=(1,))
        assert pair.run().ok
        assert time.monotonic() - start >= 6 / 16 * 0.9  # 6 KiB at 16 KiB/s
    finally:
        pair.close()


def test_the_same_gpu_path_streams_batches(monkeypatch) -> None:
    """CUDA IPC with the CUDA boundary replaced by the tensors themselves (as test_transceiver_ipc_flow.py)."""
    holder: dict[str, KVCacheManager] = {}
    monkeypatch.setattr(sender_mod, "ipc_identity", lambda pools, enabled: CTX if enabled else None)
    monkeypatch.setattr(sender_mod, "export_pools", lambda pools, identity: IpcOffer(identity=identity, pools=[]))
    monkeypatch.setattr(receiver_mod, "ipc_identity", lambda pools, enabled: GEN if enabled else None)
    monkeypatch.setattr(receiver_mod, "open_pools", lambda offer, own: {W: holder["ctx"].pool(W, Level.PRIMARY)})
    pair = Pair()
    holder["ctx"] = pair.ctx
    try:
        pair.rx.probe(pair.sender.endpoint)  # the handshake opens the pools first
        wait_until(lambda: pair.rx.peer_status().get(pair.sender.endpoint) == "compatible", 10, "the handshake",
                   step=lambda: (pair.sender.step(), pair.rx.step(), time.sleep(0.002)))
        pair.sender.open_stream("req", {W: 6})
        pair.pull()
        assert pair.prefill(0, 3)
        _until_written(pair, 3)
        assert pair.prefill(3, 3, final=True, first_tokens=(9,))
        result = pair.run()
        assert (result.ok, result.first_tokens) == (True, (9,)), result.error
        assert pair.written() == [1000 + b for b in range(6)]
        assert (pair.sender.stats.ipc_transfers, pair.rx.stats.ipc_transfers) == (1, 1)
        pair.settle()
    finally:
        pair.close()
