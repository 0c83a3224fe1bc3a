"""KV transfer throughput: the transceiver against raw pyzmq, same bytes, same two processes, same run.

    pdserve-bench transfer [--sizes 16 64 256] [--repeat 5] [--chunk-mib 8]

The parent process is the generation side (KVReceiver + KVCacheManager); it starts this module
(`python -m pdserve_bench.transfer_bench --context ...`) as the context side (KVSender +
KVCacheManager), driven by JSON lines on stdin/stdout.
Per size and repeat:
- transceiver: the context side "prefills" a request of that many KV bytes (random bytes in its
  slots) and leases it; timed from `start_pull` to the ok `PullResult` (chunks gathered, sent,
  checksummed, scattered into the receiver's slots, Ack sent), over an already connected link;
- raw pyzmq: the context side pushes the same number of bytes from a preallocated buffer as
  frames of --chunk-mib with copy=False over a PUSH/PULL pair; the receiver copies every frame
  into a preallocated buffer (numpy, the fastest copy measured here); timed from the request to
  the last byte copied.
The two are interleaved; the table shows the best and the median of the repeats (GB/s = 1e9 B/s).
One record per size.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import time

import numpy as np
import torch
import zmq

from kvcache import CacheLayout, KvCacheConfig, KVCacheManager, KVFormat, Level
from pdserve_bench import options
from transceiver.config import TransceiverConfig

HELP = "KV transfer throughput: the transceiver against raw pyzmq, same bytes, same run"

TOKEN = "bench-transfer-token-0123456789"
TPB = 32
LAYERS = 8  # slot = 8 layers * 2 * 32 tokens * 8 kv heads * 128 * bf16 = 1 MiB per block
MIB = 1 << 20


def make_kv(max_mib: int) -> KVCacheManager:
    blocks = max_mib + 8  # one slot per MiB, plus room
    layout = CacheLayout(layer_windows=(blocks * TPB,) * LAYERS, format=KVFormat(torch.bfloat16, 8, 128),
                         device="cpu", max_seq_len=blocks * TPB)
    return KVCacheManager(KvCacheConfig(tokens_per_block=TPB, max_tokens=blocks * TPB,
                                        enable_block_reuse=False), layout)


def tokens_of(rid: int, mib: int) -> list[int]:
    return [(rid * 131 + i) % 30000 for i in range(mib * TPB)]  # one block (1 MiB) per 32 tokens


# ---- context side -----------------------------------------------------------------------------


class ContextSide:
    def __init__(self, max_mib: int, chunk: int) -> None:
        from transceiver.sender import KVSender

        self.kv = make_kv(max_mib)
        self.window = self.kv.window_sizes[0]
        self.sender = KVSender(self.kv, TransceiverConfig(auth_token=TOKEN, max_chunk_bytes=chunk), "bench")
        self.kv.pool(self.window, Level.PRIMARY).view(torch.uint8).random_(0, 256)  # "prefilled" KV
        self.raw = zmq.Context.instance().socket(zmq.PUSH)
        self.raw.setsockopt(zmq.LINGER, 0)
        self.raw_port = self.raw.bind_to_random_port("tcp://127.0.0.1")
        self.raw_src = torch.empty(max_mib * MIB, dtype=torch.uint8).random_(0, 256)
        self.chunk = chunk

    def handle(self, cmd: dict) -> dict:
        if cmd["op"] == "lease":
            rid = f"r{cmd['rid']}"
            self.kv.admit(rid, tokens_of(cmd["rid"], cmd["mib"]))
            self.sender.add_lease(rid, {self.window: self.kv.block_ids(rid, self.window)})
            self.kv.release(rid)
        elif cmd["op"] == "raw":
            view = memoryview(self.raw_src.numpy())
            for start in range(0, cmd["mib"] * MIB, self.chunk):
                self.raw.send(view[start : start + self.chunk], copy=False)
        return {"leases": self.sender.num_leases}


def context_main(max_mib: int, chunk: int) -> None:
    side = ContextSide(max_mib, chunk)
    print(json.dumps({"endpoint": side.sender.endpoint, "epoch": side.sender.epoch,
                      "raw": f"tcp://127.0.0.1:{side.raw_port}"}), flush=True)
    buf = b""
    while True:
        if select.select([0], [], [], 0)[0]:
            data = os.read(0, 65536)
            if not data:
                break
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                print(json.dumps(side.handle(json.loads(line))), flush=True)
        side.sender.step()
        side.sender.wait(0.001)
    side.sender.close()


# ---- generation side --------------------------------------------------------------------------


class Bench:
    def __init__(self, max_mib: int, chunk: int) -> None:
        from transceiver.receiver import KVReceiver

        argv = [sys.executable, "-m", "pdserve_bench.transfer_bench", "--context", str(max_mib), str(chunk)]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        info = json.loads(self.proc.stdout.readline())
        self.endpoint, self.epoch = info["endpoint"], info["epoch"]
        self.kv = make_kv(max_mib)
        self.window = self.kv.window_sizes[0]
        self.rx = KVReceiver(self.kv, TransceiverConfig(auth_token=TOKEN, max_chunk_bytes=chunk), "bench")
        self.pull_sock = zmq.Context.instance().socket(zmq.PULL)
        self.pull_sock.setsockopt(zmq.LINGER, 0)
        self.pull_sock.connect(info["raw"])
        self.raw_dst = np.ones(max_mib * MIB, dtype=np.uint8)  # touched: no first-write page faults
        self.chunk = chunk
        self.next_rid = 0

    def call(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def transceiver_seconds(self, mib: int) -> float:
        self.next_rid += 1
        rid = f"r{self.next_rid}"
        self.call(op="lease", rid=self.next_rid, mib=mib)
        self.kv.admit(rid, tokens_of(self.next_rid, mib))
        slots = self.kv.slot_table(rid, self.window)
        start = time.perf_counter()
        self.rx.start_pull(rid, self.endpoint, self.epoch, rid, {self.window: (0, slots)})
        while not (results := self.rx.step()):
            self.rx.wait(0.001)
        seconds = time.perf_counter() - start
        self.kv.release(rid)
        [result] = results
        assert result.ok and result.nbytes == mib * MIB, result
        return seconds

    def raw_seconds(self, mib: int) -> float:
        start = time.perf_counter()
        self.proc.stdin.write(json.dumps({"op": "raw", "mib": mib}) + "\n")
        self.proc.stdin.flush()
        offset = 0
        while offset < mib * MIB:
            assert self.pull_sock.poll(30000), "raw transfer stalled"
            part = np.frombuffer(self.pull_sock.recv(copy=False).buffer, dtype=np.uint8)
            self.raw_dst[offset : offset + part.size] = part  # numpy copy: the fastest one here
            offset += part.size
        seconds = time.perf_counter() - start
        self.proc.stdout.readline()  # the command's answer
        return seconds

    def close(self) -> None:
        self.rx.close()
        self.pull_sock.close(linger=0)
        self.proc.stdin.close()
        self.proc.wait(30)


def measure(sizes: list[int], repeats: int, chunk: int) -> list[dict]:
    bench = Bench(max(sizes), chunk)
    try:
        bench.transceiver_seconds(1)  # warm-up: connect and handshake once
        bench.raw_seconds(1)
        rows = []
        for mib in sizes:
            xs, rs = [], []
            for _ in range(repeats):
                xs.append(bench.transceiver_seconds(mib))
                rs.append(bench.raw_seconds(mib))
            gb = mib * MIB / 1e9
            rows.append({"mib": mib, "xfer_best": gb / min(xs), "xfer_median": gb / statistics.median(xs),
                         "raw_best": gb / min(rs), "raw_median": gb / statistics.median(rs),
                         "repeats": [{"xfer_gb_s": gb / x, "raw_gb_s": gb / r} for x, r in zip(xs, rs, strict=True)]})
        return rows
    finally:
        bench.close()


def table(rows: list[dict], chunk: int) -> str:
    lines = ["| KV size | transceiver GB/s best (median) | raw pyzmq GB/s best (median) | ratio best (median) |",
             "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['mib']} MiB | {r['xfer_best']:.2f} ({r['xfer_median']:.2f}) | "
                     f"{r['raw_best']:.2f} ({r['raw_median']:.2f}) | {r['xfer_best'] / r['raw_best']:.0%} "
                     f"({r['xfer_median'] / r['raw_median']:.0%}) |")
    cpus = len(os.sched_getaffinity(0))
    lines.append(f"\nframes of {chunk // MIB} MiB, tcp://127.0.0.1, {cpus} CPUs, torch {torch.__version__}, "
                 f"pyzmq {zmq.__version__} (libzmq {zmq.zmq_version()})")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 64, 256], help="MiB of KV per transfer")
    parser.add_argument("--chunk-mib", type=int, default=8, help="max_chunk_bytes / raw frame size, MiB")
    options.add_common(parser, repeat=5, model=False)


def run(args: argparse.Namespace) -> int:
    out = options.writer(args)
    chunk = args.chunk_mib * MIB
    rows = measure(args.sizes, args.repeat, chunk)
    print(table(rows, chunk))
    for row in rows:
        figures = {k: v for k, v in row.items() if k not in ("mib", "repeats")}
        figures |= {"ratio_best": row["xfer_best"] / row["raw_best"],
                    "ratio_median": row["xfer_median"] / row["raw_median"]}
        config = {"kv_mib": row["mib"], "chunk_mib": args.chunk_mib, "repeat": args.repeat,
                  "link": "tcp://127.0.0.1", "pyzmq": zmq.__version__, "libzmq": zmq.zmq_version()}
        out.write("transfer", config, figures, row["repeats"])
    return 0


if __name__ == "__main__":  # the context side, started by `Bench`
    if len(sys.argv) != 4 or sys.argv[1] != "--context":
        raise SystemExit("this module is the context side of `pdserve-bench transfer`; run that instead")
    context_main(int(sys.argv[2]), int(sys.argv[3]))
