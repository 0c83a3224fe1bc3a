"""Shared pieces of the two-process KV transfer tests (CPU integration and CUDA).

A context process is a child Python process driven by JSON lines on stdin/stdout; between commands
it steps its KVSender. Blocks hold a byte pattern derived from (window, block index, block tokens),
so the generation side can check every byte it received.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import select
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from waiting import wait_until

from kvcache import KVCacheManager, Level

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def delivered(thread, count: int, timeout_s: float = 5.0) -> list:
    """What a `link.SocketThread` handed over, once `count` items came (waits on its wake-up)."""
    items: list = []

    def arrived() -> bool:
        items.extend(thread.drain())
        return len(items) >= count

    wait_until(arrived, timeout_s, f"{count} item(s) from the socket thread", step=lambda: thread.wait(0.05),
               on_timeout=lambda: f"got {items}")
    return items


def pattern(window: int, index: int, tokens: list[int], nbytes: int, device: str | torch.device) -> torch.Tensor:
    """The bytes block `index` of `window` holds for `tokens` (its own tokens), the same on both sides."""
    digest = hashlib.sha256(f"{window}:{index}:{tokens}".encode()).digest()
    g = torch.Generator(device=device).manual_seed(int.from_bytes(digest[:7], "little"))
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g, device=device)


def slot_view(kv: KVCacheManager, window: int, slot: int) -> torch.Tensor:
    return kv.pool(window, Level.PRIMARY)[slot].view(-1).view(torch.uint8)  # [slot_bytes]


def _block_pattern(kv: KVCacheManager, window: int, index: int, tokens: list[int]) -> torch.Tensor:
    tpb = kv.tokens_per_block
    return pattern(window, index, tokens[index * tpb:(index + 1) * tpb], kv.slot_bytes(window), kv.layout.device)


def fill(kv: KVCacheManager, rid: str, tokens: list[int], from_token: int) -> None:
    """'Prefill': write the pattern into every block from token `from_token` on."""
    for w in kv.window_sizes:
        for i, slot in enumerate(kv.slot_table(rid, w)):
            if slot >= 0 and (i + 1) * kv.tokens_per_block > from_token:
                slot_view(kv, w, slot).copy_(_block_pattern(kv, w, i, tokens))


def write_prompt(kv: KVCacheManager, rid: str, tokens: list[int]) -> int:
    """The context side's 'prefill' of a request: admitted, the pattern written past its cache hit,
    its blocks committed; the hit, in tokens."""
    hit = kv.admit(rid, tokens)
    fill(kv, rid, tokens, hit)
    kv.commit(rid, tokens, len(tokens))
    return hit


class ContextSide:
    """The context process of the two-process tests: `kv` and its KVSender, answering the parent's
    JSON commands ("cache", "prefill", "state"; subclasses add theirs in `handle` and figures in
    `state`)."""

    def __init__(self, kv: KVCacheManager, sender) -> None:
        self.kv, self.sender = kv, sender

    def cache(self, rid: str, tokens: list[int]) -> dict:
        hit = write_prompt(self.kv, rid, tokens)
        self.kv.release(rid)
        return {"hit": hit}

    def prefill(self, rid: str, tokens: list[int]) -> dict:
        """Written, then leased: its block ids and their slots per window (-1 out of the window)."""
        hit = write_prompt(self.kv, rid, tokens)
        self.kv.release_out_of_window(rid, len(tokens))
        blocks = {w: self.kv.block_ids(rid, w) for w in self.kv.window_sizes}
        slots = {w: self.kv.get_memory_pool_block_indices(ids, w) for w, ids in blocks.items()}
        self.sender.add_lease(rid, blocks)
        self.kv.release(rid)
        stats = self.kv.stats()
        return {"hit": hit, "blocks": blocks, "slots": slots, "offloads": stats.offloads, "onboards": stats.onboards}

    def state(self) -> dict:
        try:
            self.kv.check_integrity()
            integrity = "ok"
        except Exception as e:  # reported to the test, which asserts on it
            integrity = str(e)
        s = self.sender.stats
        return {"leases": self.sender.num_leases, "integrity": integrity,
                "in_use": sum(n for (_, _, state), n in self.kv.stats().blocks.items() if state == "in_use"),
                "transfers_ok": s.transfers_ok, "failures": s.failures_by_reason}

    def handle(self, cmd: dict) -> dict:
        if cmd["op"] == "cache":
            return self.cache(cmd["rid"], cmd["tokens"])
        if cmd["op"] == "prefill":
            return self.prefill(cmd["rid"], cmd["tokens"])
        return self.state()


def assert_blocks_match(kv: KVCacheManager, rid: str, tokens: list[int]) -> int:
    """Every held block of the request has the pattern of its tokens; returns blocks checked."""
    checked = 0
    for w in kv.window_sizes:
        for i, slot in enumerate(kv.slot_table(rid, w)[: math.ceil(len(tokens) / kv.tokens_per_block)]):
            if slot >= 0:
                assert torch.equal(slot_view(kv, w, slot), _block_pattern(kv, w, i, tokens)), f"window {w} block {i}"
                checked += 1
    return checked


def tokens_for(topic: int, n: int) -> list[int]:
    return [(topic * 7919 + i * 31) % 1000 + 1 for i in range(n)]


def serve_json_commands(handle: Callable[[dict], dict], tick: Callable[[], None],
                        idle_wait_s: Callable[[], float]) -> None:
    """Child side: answer each JSON line on stdin with one on stdout; `tick()` in between; EOF ends."""
    buf = b""
    while True:
        if select.select([0], [], [], idle_wait_s())[0]:
            data = os.read(0, 1 << 20)
            if not data:
                return
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                print(json.dumps(handle(json.loads(line))), flush=True)
        tick()


class JsonChild:
    """Parent side: runs `call` (e.g. "ctx_main(3)") of the test module `module` in a child Python
    process, with tests/ and the module's folder on its path; the child's first line is `hello`."""

    def __init__(self, module: str | Path, call: str, startup_timeout_s: float, read_timeout_s: float) -> None:
        module = Path(module)
        code = (f"import sys; sys.path[:0] = [{str(module.parent)!r}, {str(TESTS)!r}]; "
                f"import {module.stem} as m; m.{call}")
        self.read_timeout_s = read_timeout_s
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, cwd=ROOT)
        self.hello = self._read(startup_timeout_s)

    def _read(self, timeout_s: float | None = None) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s or self.read_timeout_s)
        assert ready, "child process did not answer"
        line = self.proc.stdout.readline()
        assert line, f"child process exited with {self.proc.poll()}"
        return json.loads(line)

    def call(self, op: str, **kw) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def wait_state(self, cond: Callable[[dict], bool], timeout_s: float = 10.0) -> dict:
        """The child's state once `cond(state)` holds."""
        return wait_until(lambda: self.call("state"), timeout_s, "the child's state", check=cond)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def stop(self, grace_s: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.kill()
