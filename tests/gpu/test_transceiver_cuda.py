"""KV transfer between two real processes on one GPU, each with a real KVCacheManager on CUDA pools.

The context process (`ctx_main`, driven over JSON lines on stdin/stdout) writes a byte pattern
derived from each block's tokens into its slots, after forcing offload/onboard so that block ids
differ from slots, and leases the blocks; this process plays the generation server, pulls, and
checks every byte on the GPU. The same-GPU path (CUDA IPC handles of the pools, device-to-device
copy) is the default; `same_host_ipc: false` on either side, or both ends in one process, take the
byte path (gather -> pinned staging -> ZeroMQ -> scatter), which is checked on CUDA pools too.
"""

from __future__ import annotations

import json
import time

import pytest
import torch
from kv_factories import make_manager
from kv_transfer_harness import (
    ContextSide,
    JsonChild,
    assert_blocks_match,
    fill,
    serve_json_commands,
    tokens_for,
)
from waiting import wait_until

from kvcache import KVCacheManager, Level
from server.engine.kv_connector import blocks_to_pull
from transceiver.config import TransceiverConfig
from transceiver.receiver import KVReceiver, PullResult

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

TOKEN = "gpu-transceiver-token-0123456789"
FINGERPRINT = "gpu-test:v1"
# "vswa": layers 0, 2 slide over 32 tokens, 1, 3 are full; slot 2 layers * 2 * 8 tpb * 8 heads * 128 * 2 B = 64 KiB
# "8b": Llama-3.1-8B's KV (32 layers, 8 kv heads, 128 dims, bf16), 32 tokens per block: 4 MiB slots
SHAPES = {"vswa": dict(windows=(32, 256, 32, 256), max_seq_len=256, tpb=8),
          "8b": dict(windows=(8192,) * 32, max_seq_len=8192, tpb=32)}


def make_kv(shape: str, max_blocks: int, host_blocks: int = 0) -> KVCacheManager:
    s = SHAPES[shape]
    return make_manager("cuda", tpb=s["tpb"], primary_blocks=max_blocks, host_blocks=host_blocks, windows=s["windows"],
                        max_seq_len=s["max_seq_len"], heads=8, dim=128, dtype=torch.bfloat16,
                        secondary_offload_min_priority=0)


# ---- the context process ---------------------------------------------------------------------


class _Ctx(ContextSide):
    def __init__(self, shape: str, same_host_ipc: bool) -> None:
        from transceiver.sender import KVSender

        kv = make_kv(shape, max_blocks=16, host_blocks=64) if shape == "vswa" else make_kv(shape, 160)
        cfg = TransceiverConfig(auth_token=TOKEN, same_host_ipc=same_host_ipc, max_chunk_bytes=1 << 20)
        super().__init__(kv, KVSender(kv, cfg, FINGERPRINT))

    def state(self) -> dict:
        return {**super().state(), "ipc_enabled": self.sender.ipc_identity is not None,
                "ipc_exports": self.sender.ipc_exports, "ipc_transfers": self.sender.stats.ipc_transfers}


def ctx_main(shape: str, same_host_ipc: bool) -> None:
    """Context process: answers JSON commands on stdin; between them waits on and steps the sender."""
    ctx = _Ctx(shape, same_host_ipc)
    print(json.dumps({"endpoint": ctx.sender.endpoint, "epoch": ctx.sender.epoch}), flush=True)

    def tick() -> None:
        ctx.sender.wait(0.002)
        ctx.sender.step()

    serve_json_commands(ctx.handle, tick, lambda: 0)
    ctx.sender.close()


class CtxProcess(JsonChild):
    def __init__(self, shape: str, same_host_ipc: bool = True) -> None:
        super().__init__(__file__, f"ctx_main({shape!r}, {same_host_ipc})", startup_timeout_s=120, read_timeout_s=60)
        self.endpoint, self.epoch = self.hello["endpoint"], self.hello["epoch"]

    def stop(self, grace_s: float = 20.0) -> None:  # a CUDA context takes longer to tear down
        super().stop(grace_s)


# ---- the generation side (this process) ------------------------------------------------------


def pull(rx: KVReceiver, ctx: CtxProcess, rid: str, tokens: list[int], hit_tokens: int = 0) -> PullResult:
    kv = rx._kv
    hit = kv.admit(rid, tokens, max_cached_tokens=hit_tokens)
    rx.start_pull(rid, ctx.endpoint, ctx.epoch, rid, blocks_to_pull(kv, rid, len(tokens), hit))
    [result] = wait_until(rx.step, 30, "a pull result", step=lambda: rx.wait(0.001))
    return result


def offloaded_prefill(ctx: CtxProcess, rid: str, topic: int) -> list[int]:
    """A 101-token request whose first 10 blocks came back from the host pool (ids != slots)."""
    shared = tokens_for(topic, 96)
    ctx.call("cache", rid=f"{rid}-warm", tokens=shared)  # 12 blocks, cached
    ctx.call("cache", rid=f"{rid}-filler", tokens=tokens_for(topic + 1, 112))  # 14 blocks: offloads the warm ones
    tokens = shared[:80] + tokens_for(topic + 2, 21)
    info = ctx.call("prefill", rid=rid, tokens=tokens)
    assert info["hit"] == 80 and info["offloads"] > 0 and info["onboards"] > 0
    live = [b for b in info["blocks"]["256"] if b >= 0]
    assert any(b != s for b, s in zip(live, info["slots"]["256"], strict=True)), "ids should differ from slots"
    return tokens


def vswa_receiver(same_host_ipc: bool) -> KVReceiver:
    kv = make_kv("vswa", max_blocks=32)
    return KVReceiver(kv, TransceiverConfig(auth_token=TOKEN, same_host_ipc=same_host_ipc), FINGERPRINT)


def check_pull(rx: KVReceiver, ctx: CtxProcess, rid: str, topic: int, via_ipc: bool) -> None:
    tokens = offloaded_prefill(ctx, rid, topic)
    kv = rx._kv  # the generation side already holds the first 3 blocks of the prompt
    kv.admit(f"{rid}-seed", tokens[:24])
    fill(kv, f"{rid}-seed", tokens[:24], 0)
    kv.commit(f"{rid}-seed", tokens[:24], 24)
    kv.release(f"{rid}-seed")
    before = (rx.stats.ipc_transfers, rx.stats.bytes_received)
    result = pull(rx, ctx, rid, tokens, hit_tokens=100)
    assert result.ok, result.error
    assert result.nbytes == 15 * 65536 == rx.stats.bytes_received - before[1]  # blocks 3..12 + in-window 8..12
    assert rx.stats.ipc_transfers - before[0] == int(via_ipc)
    assert assert_blocks_match(rx._kv, rid, tokens) == 13 + 5
    state = ctx.wait_state(lambda s: s["leases"] == 0)
    assert (state["leases"], state["in_use"], state["integrity"], state["failures"]) == (0, 0, "ok", {})
    rx._kv.release(rid)
    rx._kv.check_integrity()


def test_ipc_pull_on_one_gpu_after_offload_moves_every_byte_and_ends_the_lease() -> None:
    ctx = CtxProcess("vswa")
    rx = vswa_receiver(same_host_ipc=True)
    try:
        assert ctx.call("state")["ipc_enabled"]
        check_pull(rx, ctx, "req-a", topic=10, via_ipc=True)
        check_pull(rx, ctx, "req-b", topic=20, via_ipc=True)  # same (endpoint, epoch): the pools stay open
        assert list(rx._ipc_pools) == [ctx.endpoint] and rx.stats.ipc_open_failures == 0
        state = ctx.call("state")
        assert (state["transfers_ok"], state["ipc_transfers"], state["ipc_exports"]) == (2, 2, 1)
    finally:
        rx.close()
        ctx.stop()


@pytest.mark.parametrize("off_side", ["ctx", "gen"])
def test_same_host_ipc_false_on_either_side_takes_the_byte_path_on_cuda_pools(off_side: str) -> None:
    ctx = CtxProcess("vswa", same_host_ipc=off_side != "ctx")
    rx = vswa_receiver(same_host_ipc=off_side != "gen")
    try:
        assert ctx.call("state")["ipc_enabled"] is (off_side != "ctx")
        check_pull(rx, ctx, "req-c", topic=30, via_ipc=False)
        state = ctx.call("state")
        assert (state["ipc_transfers"], state["ipc_exports"], rx._ipc_pools) == (0, 0, {})
    finally:
        rx.close()
        ctx.stop()


def test_both_ends_in_one_process_take_the_byte_path() -> None:
    from transceiver.sender import KVSender

    ctx_kv = make_kv("vswa", max_blocks=16)
    sender = KVSender(ctx_kv, TransceiverConfig(auth_token=TOKEN), FINGERPRINT)
    rx = KVReceiver(make_kv("vswa", max_blocks=32), TransceiverConfig(auth_token=TOKEN), FINGERPRINT)
    try:
        assert sender.ipc_identity is not None  # on, but a handle cannot be opened by its own process
        tokens = tokens_for(4, 60)
        ctx_kv.admit("r", tokens)
        fill(ctx_kv, "r", tokens, 0)
        sender.add_lease("r", {w: ctx_kv.block_ids("r", w) for w in ctx_kv.window_sizes})
        ctx_kv.release("r")
        rx._kv.admit("r", tokens)
        rx.start_pull("r", sender.endpoint, sender.epoch, "r", {w: (0, rx._kv.slot_table("r", w))
                                                                for w in rx._kv.window_sizes})
        def step_both() -> list[PullResult]:
            sender.step()
            return rx.step()

        results = wait_until(step_both, 30, "a pull result", step=lambda: rx.wait(0.001))
        assert results[0].ok, results
        assert (rx.stats.ipc_transfers, sender.stats.ipc_transfers, sender.ipc_exports) == (0, 0, 0)
        assert assert_blocks_match(rx._kv, "r", tokens) == 8 + 8
    finally:
        rx.close()
        sender.close()


def device_ms(kv: KVCacheManager, what: str, repeats: int = 5) -> float:
    """Best time of `ipc.start_checksum` or `ipc.start_copy`, waited for, over 128 scattered 4 MiB slots."""
    from transceiver import ipc

    pool = kv.pool(8192, Level.PRIMARY)
    src = list(range(159, 31, -1))  # 128 slots, reversed: no run of consecutive slots
    dst = torch.empty((128, *pool.shape[1:]), dtype=pool.dtype, device="cuda")
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        if what == "checksum":
            ipc.start_checksum(pool, src, 0).synchronize()
        else:
            ipc.start_copy(pool, src, dst, list(range(128)), 0).synchronize()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def test_ipc_handoff_of_a_4096_token_8b_kv() -> None:
    """512 MiB of Llama-3.1-8B KV: every byte checked; the time of the second pull (no handshake)."""
    ctx = CtxProcess("8b")
    rx = KVReceiver(make_kv("8b", max_blocks=160), TransceiverConfig(auth_token=TOKEN), FINGERPRINT)
    try:
        seconds = []
        for rid, topic in (("big-a", 5), ("big-b", 6)):
            tokens = tokens_for(topic, 4096)
            ctx.call("prefill", rid=rid, tokens=tokens)
            result = pull(rx, ctx, rid, tokens)
            assert result.ok, result.error
            assert result.nbytes == 128 * (4 << 20) and assert_blocks_match(rx._kv, rid, tokens) == 128
            seconds.append(result.seconds)
            rx._kv.release(rid)
        print(f"8B KV handoff, 512 MiB over CUDA IPC: first pull {seconds[0] * 1e3:.2f} ms "
              f"(handshake + handle open), second {seconds[1] * 1e3:.2f} ms "
              f"({512 / 1024 / seconds[1]:.0f} GiB/s)")
        print(f"  of which, in this process: {device_ms(rx._kv, 'checksum'):.2f} ms to checksum 512 MiB of "
              f"slots, {device_ms(rx._kv, 'copy'):.2f} ms to copy them and checksum the copy")
        assert rx.stats.ipc_transfers == 2
        assert seconds[1] < 0.05, f"{seconds[1] * 1e3:.1f} ms (the byte path took ~190 ms)"
        state = ctx.wait_state(lambda s: s["leases"] == 0)
        assert (state["leases"], state["in_use"], state["ipc_transfers"], state["ipc_exports"]) == (0, 0, 2, 1)
    finally:
        rx.close()
        ctx.stop()
