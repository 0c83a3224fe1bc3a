"""The same-GPU handoff's fused kernels and asynchronous checksums on CUDA (transceiver/kernels.py,
transceiver/ipc.py, transceiver/receiver/ipc_copies.py):

- the compiled kernels bit for bit against the torch path on Llama-3.1-8B-shaped slots (4 MiB,
  bf16) and on odd-sized slots summed by bytes; the time of both paths over 512 MiB is printed;
- `start_checksum` and `IpcCopies.start` return while the device is still busy (a sleeping kernel
  queued before them), and the values they give once done are right;
- no late writer: a copy abandoned while still queued runs before whatever the engine's stream
  writes into its blocks afterwards.

    pytest -q -s tests/gpu/test_transceiver_kernels_cuda.py
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import pytest
import torch

if TYPE_CHECKING:
    from transceiver.ipc import DeviceSum

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SLOT_8B = (32, 2, 32, 8, 128)  # layers, K/V, tokens per block, KV heads, head dim: 4 MiB of bf16
SLEEP_CYCLES = 200_000_000  # ~0.1 s of one SM at ~2 GHz: the device stays busy while the host goes on


def _pool(num_slots: int, slot_shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    count = num_slots * int(torch.tensor(slot_shape).prod()) * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (count,), dtype=torch.uint8, device="cuda", generator=g)
    return raw.view(dtype).view(num_slots, *slot_shape)


def _value(checksum: DeviceSum) -> int:
    """The checksum once the device has finished it."""
    checksum.synchronize()
    return checksum.value()


def _torch_path(monkeypatch) -> None:
    from transceiver.ipc import KERNELS_ENV

    monkeypatch.setenv(KERNELS_ENV, "torch")


@pytest.mark.parametrize("slot_shape, dtype", [(SLOT_8B, torch.bfloat16), ((3, 5, 2), torch.uint8)])
def test_fused_kernels_equal_the_torch_path(monkeypatch, slot_shape, dtype) -> None:
    from transceiver import ipc
    from transceiver.payload import pool_rows

    src, dst = _pool(160, slot_shape, dtype, 1), _pool(160, slot_shape, dtype, 2)
    src_slots, dst_slots = list(range(159, 31, -1)), list(range(7, 135))  # 128 scattered slots
    fused = _value(ipc.start_checksum(src, src_slots, 5))
    written = _value(ipc.start_copy(src, src_slots, dst, dst_slots, 5))
    assert torch.equal(pool_rows(dst)[dst_slots], pool_rows(src)[src_slots])
    _torch_path(monkeypatch)
    assert fused == written == _value(ipc.start_checksum(src, src_slots, 5))
    assert fused == _value(ipc.start_checksum(dst, dst_slots, 5))
    raw = src.view(160, -1).view(torch.uint8)
    raw[src_slots[77], 12345 % raw.shape[1]] ^= 1
    monkeypatch.undo()
    assert _value(ipc.start_checksum(src, src_slots, 5)) != fused


def _best_ms(fn, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def test_time_of_both_paths_over_512_mib(monkeypatch) -> None:
    from transceiver import ipc

    src, dst = _pool(160, SLOT_8B, torch.bfloat16, 3), _pool(128, SLOT_8B, torch.bfloat16, 4)
    src_slots, dst_slots = list(range(159, 31, -1)), list(range(128))
    times = {}
    for path in ("triton", "torch"):
        monkeypatch.setenv(ipc.KERNELS_ENV, path)
        times[path] = (_best_ms(lambda: _value(ipc.start_checksum(src, src_slots, 0))),
                       _best_ms(lambda: _value(ipc.start_copy(src, src_slots, dst, dst_slots, 0))))
    print(f"512 MiB of 8B KV: checksum {times['triton'][0]:.2f} ms fused vs {times['torch'][0]:.2f} ms "
          f"gather+sum; copy+checksum {times['triton'][1]:.2f} ms fused vs {times['torch'][1]:.2f} ms "
          f"gather+scatter+sum")


def test_checksums_and_copies_are_queued_not_waited_for() -> None:
    from transceiver import ipc
    from transceiver.payload import pool_rows
    from transceiver.receiver.ipc_copies import IpcCopies
    from transceiver.wire import IpcChunk

    src, dst = _pool(64, SLOT_8B, torch.bfloat16, 5), _pool(64, SLOT_8B, torch.bfloat16, 6)
    expected = _value(ipc.start_checksum(src, list(range(32)), 0))
    _value(ipc.start_copy(src, [0], dst, [0], 0))  # both kernels compiled before anything is timed
    torch.cuda.synchronize()
    woken = []
    copies = IpcCopies(notify=lambda: woken.append(time.monotonic()))
    try:
        torch.cuda._sleep(SLEEP_CYCLES)  # the engine's stream is busy: the side stream waits for it
        start = time.perf_counter()
        pending = ipc.start_checksum(src, list(range(32)), 0)  # queued behind the sleep, same stream
        chunk = IpcChunk(pull_id=1, window=0, first=0, slots=list(range(32)), checksum=expected)
        copies.start(1, chunk, src, dst, list(range(32, 64)), 32 * (4 << 20))
        queued_ms = (time.perf_counter() - start) * 1e3
        assert not pending.done() and copies.settled() == [] and copies.pending(1)
        assert queued_ms < 20, f"queueing took {queued_ms:.1f} ms: something waited for the device"
        assert _value(pending) == expected
        torch.cuda.synchronize()
        [copy] = copies.settled()
        assert copy.checksum.value() == expected and not copies.pending(1)
        assert torch.equal(pool_rows(dst)[32:64], pool_rows(src)[:32])
        assert woken, "the watcher did not wake the engine"
    finally:
        copies.close()


def test_an_abandoned_copy_runs_before_later_engine_writes_to_its_blocks() -> None:
    from transceiver import ipc
    from transceiver.payload import pool_rows
    from transceiver.receiver.ipc_copies import IpcCopies
    from transceiver.wire import IpcChunk

    src, dst = _pool(64, SLOT_8B, torch.bfloat16, 7), _pool(64, SLOT_8B, torch.bfloat16, 8)
    _value(ipc.start_copy(src, [63], dst, [63], 0))  # compiled before the test
    torch.cuda.synchronize()
    copies = IpcCopies()
    try:
        torch.cuda._sleep(SLEEP_CYCLES)
        chunk = IpcChunk(pull_id=2, window=0, first=0, slots=list(range(32)), checksum=0)
        copies.start(2, chunk, src, dst, list(range(32)), 32 * (4 << 20))
        copies.abandon(2)  # the pull failed: its blocks go back to the engine
        pool_rows(dst)[:32].fill_(7)  # the engine's next write to those blocks, on its own stream
        torch.cuda.synchronize()
        assert bool((pool_rows(dst)[:32] == 7).all()), "the abandoned copy wrote after the engine"
        assert copies.settled() == [] and copies._copies == []
    finally:
        copies.close()
    written, source = (_value(ipc.start_checksum(pool, list(range(32)), 0)) for pool in (dst, src))
    assert written != source
