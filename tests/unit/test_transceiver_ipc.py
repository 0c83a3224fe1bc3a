"""The same-GPU (CUDA IPC) path of the KV transceiver, everything that runs without CUDA: the device
checksum and copy on CPU tensors (they must equal the byte path's checksum), who is offered IPC, the
receiver link's handshake (open once per epoch, forget on a new epoch, fall back when opening fails)
and the whole pull with only the CUDA boundary (export/open of handles) replaced by in-process
tensors. tests/gpu/test_transceiver_cuda.py runs the real handles between two processes."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch
import zmq
from kv_transfer_harness import delivered

import transceiver.ipc as ipc
from transceiver.config import TransceiverConfig
from transceiver.link import SocketThread, shared_context
from transceiver.payload import checksum, pool_rows
from transceiver.receiver.link import IpcPools, Pull, ReceiverLink
from transceiver.sender.link import ExportRequest, SenderLink
from transceiver.signed import SignedCodec
from transceiver.stats import TransferStats
from transceiver.wire import (
    CudaIpcPool,
    Hello,
    InstanceInfo,
    IpcOffer,
    Layout,
    PeerIdentity,
    PullRequest,
    WindowLayout,
    WindowRange,
    link_codec,
)

TOKEN = "ipc-unit-token-0123456789"
HOST = PeerIdentity(hostname="h", boot_id="b", gpu_uuid="GPU-1", pid=100)
LAYOUT = Layout(tokens_per_block=4, fingerprint="fp", windows=[
    WindowLayout(window=128, layers=[0, 1], kv_heads=2, head_dim=8, dtype="float32", slot_bytes=1024)])
POOL = CudaIpcPool(window=128, num_slots=16, device=0, handle=b"\x01" * 64, storage_size_bytes=16 * 1024,
                   storage_offset_bytes=512, ref_counter_handle=b"/torch_1_2_0", ref_counter_offset=3,
                   event_handle=b"\x02" * 64, event_sync_required=True)
OFFER = IpcOffer(identity=HOST, pools=[POOL])


def _pool(num_slots: int, slot_shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (num_slots, *slot_shape), dtype=torch.uint8, generator=g)
    return raw.view(dtype) if dtype != torch.uint8 else raw  # last dim shrinks by the element size


def _value(checksum: ipc.DeviceSum) -> int:
    """The checksum once the device has finished it."""
    checksum.synchronize()
    return checksum.value()


def _byte_checksum(pool: torch.Tensor, slots: list[int], first: int) -> int:
    rows = pool.view(pool.shape[0], -1).view(torch.uint8).numpy()  # [num_slots, slot_bytes]
    return checksum([np.ascontiguousarray(rows[slots]).reshape(-1)], rows.shape[1], first)


@pytest.mark.parametrize("slot_shape, dtype", [((2, 2, 4, 2, 32), torch.float32),  # 1 KiB slots: int64 words
                                               ((3, 5, 2), torch.uint8)])  # 30 B slots: bytes
@pytest.mark.parametrize("batch_slots", [1, 3, 1000])
def test_device_checksum_and_copy_match_the_byte_path(monkeypatch, slot_shape, dtype, batch_slots) -> None:
    src, dst = _pool(12, slot_shape, dtype, seed=1), torch.zeros_like(_pool(10, slot_shape, dtype, seed=0))
    slot_bytes = pool_rows(src).shape[1] * pool_rows(src).element_size()
    monkeypatch.setattr(ipc, "BATCH_BYTES", batch_slots * slot_bytes)
    src_slots, dst_slots = [7, 2, 11, 0, 5], [1, 9, 3, 4, 0]
    assert _value(ipc.start_checksum(src, src_slots, 3)) == _byte_checksum(src, src_slots, 3)
    written = _value(ipc.start_copy(src, src_slots, dst, dst_slots, 3))
    assert written == _byte_checksum(src, src_slots, 3) == _value(ipc.start_checksum(dst, dst_slots, 3))
    src_rows, dst_rows = pool_rows(src), pool_rows(dst)  # compared as integers (random floats hold NaNs)
    for s, d in zip(src_slots, dst_slots, strict=True):
        assert torch.equal(dst_rows[d], src_rows[s])
    assert all(torch.count_nonzero(dst_rows[d]) == 0 for d in set(range(10)) - set(dst_slots))
    assert _value(ipc.start_checksum(src, [0, 7], 3)) != _value(ipc.start_checksum(src, [7, 0], 3))  # order matters


@pytest.mark.parametrize("other, shared", [
    (PeerIdentity(hostname="h", boot_id="b", gpu_uuid="GPU-1", pid=200), True),
    (PeerIdentity(hostname="h", boot_id="b", gpu_uuid="GPU-1", pid=100), False),  # same process
    (PeerIdentity(hostname="h", boot_id="b", gpu_uuid="GPU-2", pid=200), False),
    (PeerIdentity(hostname="h", boot_id="rebooted", gpu_uuid="GPU-1", pid=200), False),
    (PeerIdentity(hostname="other", boot_id="b", gpu_uuid="GPU-1", pid=200), False),
])
def test_identity_shares_the_gpu_only_on_same_host_boot_and_gpu(other, shared) -> None:
    assert HOST.shares_gpu_with(other) is shared and other.shares_gpu_with(HOST) is shared


def test_cpu_pools_and_the_knob_never_offer_or_ask(caplog) -> None:
    pools = {128: torch.zeros(4, 8)}
    assert ipc.ipc_identity(pools, True) is None and ipc.ipc_identity(pools, False) is None
    assert ipc.export_pools(pools, HOST) is None  # logged; that receiver gets bytes
    assert "window 128: the primary pool is not a whole contiguous CUDA storage" in caplog.text


# ---- the sender's handshake answer -------------------------------------------------------------


@pytest.fixture
def ipc_sender_link():
    link = SenderLink(TransceiverConfig(auth_token=TOKEN), "ctx-epoch", LAYOUT, TransferStats(), HOST)
    thread = SocketThread("test-ipc-sender", link)
    thread.start()
    dealer = shared_context().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(link.endpoint)
    yield thread, dealer
    dealer.close(linger=0)
    thread.close()


SAME_GPU = PeerIdentity(hostname="h", boot_id="b", gpu_uuid="GPU-1", pid=7)


@pytest.mark.parametrize("hello, exported", [
    (Hello(layout=LAYOUT, identity=SAME_GPU), True),
    (Hello(layout=LAYOUT, identity=SAME_GPU, open_epoch="ctx-epoch-before-restart"), True),
    (Hello(layout=LAYOUT, identity=SAME_GPU, open_epoch="ctx-epoch"), False),  # holds our pools already
    (Hello(layout=LAYOUT, identity=PeerIdentity(hostname="h", boot_id="b", gpu_uuid="GPU-9", pid=7)), False),
    (Hello(layout=LAYOUT), False),  # CPU pools or same_host_ipc: false on the receiver
])
def test_only_a_receiver_on_our_gpu_without_our_pools_gets_an_export(ipc_sender_link, hello, exported) -> None:
    thread, dealer = ipc_sender_link
    codec = link_codec(TOKEN.encode(), "gen", sender=False)
    dealer.send_multipart(codec.seal(hello))
    if exported:  # the engine thread exports and answers
        [request] = delivered(thread, 1)
        assert isinstance(request, ExportRequest) and request.info == InstanceInfo(layout=LAYOUT)
        assert not dealer.poll(200)
    else:
        assert dealer.poll(5000)
        assert codec.open(*dealer.recv_multipart()) == ("ctx-epoch", InstanceInfo(layout=LAYOUT))
        assert thread.drain() == []


# ---- the receiver's handshake ------------------------------------------------------------------


class ScriptedContext:
    """A context server's ROUTER, driven by the test; one codec per epoch it plays."""

    def __init__(self) -> None:
        self.sock = shared_context().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.peer = b""

    def recv(self, codec: SignedCodec):
        assert self.sock.poll(5000), "the receiver sent nothing"
        self.peer, header, mac = self.sock.recv_multipart()
        return codec.open(header, mac)[1]

    def send(self, codec: SignedCodec, body) -> None:
        self.sock.send_multipart([self.peer, *codec.seal(body)])


def _pull(pull_id: int, epoch: str) -> PullRequest:
    return PullRequest(pull_id=pull_id, ctx_request_id=f"r{pull_id}", ctx_epoch=epoch,
                       ranges=[WindowRange(window=128, first=0, count=1)])



def test_receiver_opens_once_per_epoch_hands_pools_over_first_and_forgets_them() -> None:
    opened: list[IpcOffer] = []
    me = PeerIdentity(hostname="h", boot_id="b", gpu_uuid="GPU-1", pid=200)
    stats = TransferStats()
    link = ReceiverLink(TransceiverConfig(auth_token=TOKEN), "gen", LAYOUT, stats, me,
                        lambda offer: opened.append(offer) or {128: "pool-view"})
    thread, ctx = SocketThread("test-ipc-receiver", link), ScriptedContext()
    thread.start()
    first, second = link_codec(TOKEN.encode(), "e1", sender=True), link_codec(TOKEN.encode(), "e2", sender=True)
    try:
        thread.submit(Pull(ctx.endpoint, _pull(1, "e1")))
        assert ctx.recv(first) == Hello(layout=LAYOUT, identity=me, open_epoch=None)
        ctx.send(first, InstanceInfo(layout=LAYOUT, ipc=OFFER))
        assert ctx.recv(first) == msgspec.structs.replace(_pull(1, "e1"), via_ipc=True)
        thread.submit(Pull(ctx.endpoint, _pull(2, "e1")))  # same epoch: no handshake, no second open
        assert ctx.recv(first).via_ipc is True
        assert delivered(thread, 1) == [IpcPools(ctx.endpoint, "e1", {128: "pool-view"})] and opened == [OFFER]
        thread.submit(Pull(ctx.endpoint, _pull(3, "e2")))  # the context server restarted without IPC
        assert ctx.recv(first) == Hello(layout=LAYOUT, identity=me, open_epoch="e1")
        ctx.send(second, InstanceInfo(layout=LAYOUT))
        pull = ctx.recv(second)
        assert (pull.pull_id, pull.via_ipc) == (3, False)
        assert delivered(thread, 1) == [IpcPools(ctx.endpoint, None, None)] and opened == [OFFER]
        assert stats.ipc_open_failures == 0
    finally:
        thread.close()
        ctx.sock.close(linger=0)


def test_an_offer_that_cannot_be_opened_leaves_the_byte_path() -> None:
    def refuse(offer: IpcOffer) -> dict:
        raise RuntimeError("CUDA error: invalid resource handle")

    me = PeerIdentity(hostname="h", boot_id="b", gpu_uuid="GPU-1", pid=200)
    stats = TransferStats()
    link = ReceiverLink(TransceiverConfig(auth_token=TOKEN), "gen", LAYOUT, stats, me, refuse)
    thread, ctx = SocketThread("test-ipc-receiver", link), ScriptedContext()
    thread.start()
    codec = link_codec(TOKEN.encode(), "e1", sender=True)
    try:
        thread.submit(Pull(ctx.endpoint, _pull(1, "e1")))
        assert isinstance(ctx.recv(codec), Hello)
        ctx.send(codec, InstanceInfo(layout=LAYOUT, ipc=OFFER))
        assert ctx.recv(codec) == _pull(1, "e1")  # via_ipc False
        assert stats.ipc_open_failures == 1 and thread.drain() == []
    finally:
        thread.close()
        ctx.sock.close(linger=0)
