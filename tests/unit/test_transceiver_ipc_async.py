"""The same-GPU handoff never waits for the device on either side's thread (docs/DISAGG_LOAD.md):
the real KVSender and KVReceiver on CPU pools, as in test_transceiver_ipc_flow.py, where a checksum
or copy is held "on the device" (not done) until the test releases it. Meanwhile the context engine
leases another request and the sender's socket thread serves that pull to the end, and the
receiver's steps return at once; a pull whose Done came before its copy was checked finishes only
after the check; a pull cancelled with its copy still running never reports and drops the copy once
it is done. tests/gpu/test_transceiver_kernels_cuda.py holds real CUDA work behind a sleeping kernel
instead."""

from __future__ import annotations

import threading
import time

import pytest
from test_transceiver_ipc_flow import TOKEN, W, _cache, _kv, _leased, _rows, _run, _step, same_gpu  # noqa: F401
from waiting import wait_until

import transceiver.receiver.ipc_copies as copies_mod
import transceiver.sender.serve as serve_mod
from kvcache import KVCacheManager
from transceiver.config import TransceiverConfig
from transceiver.ipc import DeviceSum
from transceiver.receiver import KVReceiver
from transceiver.sender import KVSender


class Held:
    """A checksum the device has not finished until `gate` is set."""

    def __init__(self, real: DeviceSum, gate: threading.Event) -> None:
        self.real, self.gate = real, gate

    def done(self) -> bool:
        return self.gate.is_set()

    def value(self) -> int:
        assert self.done()
        return self.real.value()

    def synchronize(self) -> None:
        self.gate.wait(10)

    def order_before_current(self) -> None:
        return None


def hold_first(monkeypatch, module, name: str) -> threading.Event:
    """`module.name` (start_checksum / start_copy): its first call's result is held until the gate."""
    gate, real, calls = threading.Event(), getattr(module, name), []

    def held(*args, **kwargs):
        calls.append(1)
        result = real(*args, **kwargs)
        return Held(result, gate) if len(calls) == 1 else result

    monkeypatch.setattr(module, name, held)
    return gate


def _two_requests(ctx_kv: KVCacheManager, sender: KVSender, gen_kv: KVCacheManager):
    """The leased request "req" (6 blocks) and its destination slots on the generation side."""
    tokens, _ = _leased(ctx_kv, sender)
    gen_kv.admit("req", tokens)
    return tokens, gen_kv.slot_table("req", W)


@pytest.fixture
def pair(same_gpu):  # noqa: F811 (the fixture imported above)
    sender = KVSender(same_gpu, TransceiverConfig(auth_token=TOKEN), "fp")
    gen_kv = _kv(max_blocks=16)
    rx = KVReceiver(gen_kv, TransceiverConfig(auth_token=TOKEN), "fp")
    yield same_gpu, sender, gen_kv, rx
    rx.close()
    sender.close()


def _start_held(pair, monkeypatch, module, name: str) -> tuple[threading.Event, list[int], list[int]]:
    """`module.name`'s first result held (`hold_first`), then the pull of the leased request "req"
    started: (the gate, its tokens, its destination slots)."""
    ctx_kv, sender, gen_kv, rx = pair
    gate = hold_first(monkeypatch, module, name)
    tokens, dst = _two_requests(ctx_kv, sender, gen_kv)
    rx.start_pull("req", sender.endpoint, sender.epoch, "req", {W: (0, dst)})
    return gate, tokens, dst


def _until(probe, what: str, sender: KVSender, rx: KVReceiver) -> None:
    """Wait for `probe`, stepping both sides in between."""
    wait_until(probe, 10, what, step=lambda: (sender.step(), rx.step(), rx.wait(0.002)))


def test_the_sender_serves_other_pulls_while_a_checksum_is_on_the_device(pair, monkeypatch) -> None:
    ctx_kv, sender, gen_kv, rx = pair
    gate, tokens, dst = _start_held(pair, monkeypatch, serve_mod, "start_checksum")  # its checksum is held
    _until(lambda: sender._link._server._ipc, "the first checksum on the device", sender, rx)
    other = list(range(400, 408))  # the engine thread prefills and leases another request meanwhile
    _cache(ctx_kv, "other", other, lease=sender)
    gen_kv.admit("other", other)
    other_dst = gen_kv.slot_table("other", W)
    rx.start_pull("other", sender.endpoint, sender.epoch, "other", {W: (0, other_dst)})
    second = _run(sender, rx)  # served to the end while the first one's checksum is still running
    assert (second.request_id, second.ok) == ("other", True), second.error
    assert [int(_rows(gen_kv)[s][0]) for s in other_dst] == [1000 * other[b * 4] + b for b in range(2)]
    assert rx.num_pulls == 1 and sender.stats.ipc_transfers == 1
    gate.set()
    first = _run(sender, rx)
    assert (first.request_id, first.ok) == ("req", True), first.error
    assert [int(_rows(gen_kv)[s][0]) for s in dst] == [1000 * tokens[b * 4] + b for b in range(6)]
    wait_until(lambda: not sender.num_leases, 5, "both leases back", step=lambda: _step(sender))


def test_a_pull_finishes_only_once_its_copy_is_checked_and_steps_never_wait(pair, monkeypatch) -> None:
    _, sender, gen_kv, rx = pair
    gate, tokens, dst = _start_held(pair, monkeypatch, copies_mod, "start_copy")
    _until(lambda: any(p.done is not None for p in rx._parts.values()), "Done before the copy is checked", sender, rx)
    start = time.monotonic()
    assert rx.step() == [] and time.monotonic() - start < 0.5  # nothing waits for the held copy
    assert rx.num_pulls == 1 and sender.num_leases == 1  # no Ack yet: the lease stays pinned
    gate.set()
    result = _run(sender, rx)
    assert (result.ok, result.nbytes) == (True, 6 * 1024), result.error
    assert [int(_rows(gen_kv)[s][0]) for s in dst] == [1000 * tokens[b * 4] + b for b in range(6)]
    assert rx.stats.ipc_transfers == 1
    wait_until(lambda: not sender.num_leases, 5, "the lease back after the Ack", step=lambda: _step(sender))


def test_a_cancelled_pull_with_its_copy_running_never_reports(pair, monkeypatch) -> None:
    _, sender, _, rx = pair
    gate, _, _ = _start_held(pair, monkeypatch, copies_mod, "start_copy")
    _until(lambda: any(rx._copies.pending(pull_id) for pull_id in rx._parts), "the copy started", sender, rx)
    assert rx.cancel("req") and rx.num_pulls == 0
    assert rx._copies._copies and rx._copies._copies[0].abandoned  # kept while the device runs it
    gate.set()
    assert rx.step() == [] and rx._copies._copies == []
    wait_until(lambda: not sender.num_leases, 5, "the Cancel ends the lease", step=lambda: _step(sender))
    assert sender.stats.failures_by_reason == {"cancelled": 1}


def test_two_ranks_pull_one_lease_over_ipc_while_the_first_checksum_runs(same_gpu, monkeypatch) -> None:  # noqa: F811
    """Tensor parallel: two generation ranks that hold the same kv heads as context rank 0 (heads
    0-1 of 4) pull its lease at once, each a part of its own (keep_lease) over CUDA IPC. The first
    part's checksum is held on the "device": the second is served to the end meanwhile, then the first."""
    ctx_kv = same_gpu
    sender = KVSender(ctx_kv, TransceiverConfig(auth_token=TOKEN), "fp", kv_heads=(0, 4))
    gens = [_kv(max_blocks=16) for _ in range(2)]
    receivers = [KVReceiver(g, TransceiverConfig(auth_token=TOKEN), "fp", kv_heads=(0, 4), releases=False)
                 for g in gens]
    try:
        gate = hold_first(monkeypatch, serve_mod, "start_checksum")
        tokens, _ = _leased(ctx_kv, sender)
        dst = []
        for g, rx in zip(gens, receivers, strict=True):
            g.admit("req", tokens)
            dst.append(g.slot_table("req", W))
            rx.start_pull("req", sender.endpoint, sender.epoch, "req", {W: (0, dst[-1])})
        done: dict[int, object] = {}

        def step() -> None:
            sender.step()
            for i, rx in enumerate(receivers):
                for result in rx.step():
                    done[i] = result
            receivers[0].wait(0.002)

        wait_until(lambda: len(done) == 1, 10, "one part served while the other's checksum is held", step=step)
        gate.set()
        wait_until(lambda: len(done) == 2, 10, "the held part served too", step=step)
        assert all(r.ok for r in done.values()), done
        for g, slots in zip(gens, dst, strict=True):
            assert [int(_rows(g)[s][0]) for s in slots] == [1000 * tokens[b * 4] + b for b in range(6)]
        assert sender.stats.ipc_transfers == 2 and sender.num_leases == 1  # parts keep the lease
        receivers[0].release_lease(sender.endpoint, "req", sender.epoch)
        wait_until(lambda: not sender.num_leases, 5, "the Release ends the lease", step=lambda: _step(sender))
    finally:
        for link in (*receivers, sender):
            link.close()
