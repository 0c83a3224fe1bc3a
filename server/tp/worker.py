"""Ranks 1..N-1 of a tensor-parallel server: each a process that mirrors rank 0 on its own shards.

A rank loads its weight slices, builds its pools from rank 0's `Init`, warms up in step with rank 0,
starts its role's KV endpoint and reports `Ready`; then it applies rank 0's commands in order. It
exits on `Stop`, when rank 0's process ends (a watchdog thread), and with code 1 after a `Failure`.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
from pathlib import Path

import msgspec
import torch

from kvcache import KvCacheConfig, KVCacheManager, Level
from kvcache.block import CopyOp
from kvcache.disk_mirror import DiskMirror
from kvcache.layout import CacheLayout
from server.auth import disk_tier_key
from server.config.schema import ServerConfig
from server.models.kv_format import kv_cache_layout
from server.models.model_spec import load_spec, with_quantization
from server.models.parallel import group
from server.models.parallel.context import RankShard
from server.models.runner import ModelRunner, PendingTokens, resolve_dtype
from server.tp.channel import RankEnd
from server.tp.disk import block_metas
from server.tp.messages import (
    CheckDisk,
    Command,
    Copies,
    DiskChecked,
    Failure,
    Forward,
    Init,
    Joined,
    Op,
    Ready,
    ShareLatent,
    Stop,
)
from server.tp.roles import make_role, share_latent

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.05
BUSY_POLL_S = 0.002  # while KV transfers run
INIT_TIMEOUT_S = 600.0


class WorkerArgs(msgspec.Struct, frozen=True):
    config_json: bytes  # the server's ServerConfig (msgspec JSON)
    model_dir: str
    rank: int
    size: int
    store_port: int  # torch.distributed rendezvous on loopback
    channel: str  # rank 0's channel endpoint
    secret: str  # hex: the channel's HMAC key
    epoch: str  # the server's KV sender epoch
    device: str
    dtype: str


def main(blob: bytes) -> None:
    """The process target (its only argument: msgpack of WorkerArgs)."""
    args = msgspec.msgpack.decode(blob, type=WorkerArgs)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s rank{args.rank} %(name)s: %(message)s")
    for sig in (signal.SIGINT, signal.SIGTERM):  # a signal to the server's process group is for its drain:
        signal.signal(sig, signal.SIG_IGN)      # rank 0 stops this rank (Stop), or it exits when rank 0 is gone
    _exit_with_parent()
    end = RankEnd(bytes.fromhex(args.secret), args.channel, args.rank)
    try:
        end.report(Joined(args.rank))
        Worker(args, end).run()
    except BaseException as exc:
        log.exception("rank %d failed", args.rank)
        try:
            end.report(Failure(args.rank, f"{type(exc).__name__}: {exc}"))
        finally:
            end.close()
            os._exit(1)
    end.close()
    group.leave()


def _exit_with_parent() -> None:
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        log.error("rank 0 is gone: exiting")
        os._exit(1)

    threading.Thread(target=watch, name="pdserve-rank0-watch", daemon=True).start()


def mirror_config(config: KvCacheConfig, init: Init, layout: CacheLayout) -> KvCacheConfig:
    """This rank's pools get exactly rank 0's slot counts (its disk files: `mirror_disk`)."""
    tpb = config.tokens_per_block
    return msgspec.structs.replace(config, max_tokens=init.num_primary * tpb, free_gpu_memory_fraction=None,
                                   gpu_memory_share=None,
                                   host_cache_size=init.num_secondary * tpb * layout.bytes_per_token(), disk=None)


def mirror_disk(cfg: ServerConfig, kv: KVCacheManager, init: Init, rank: int) -> DiskMirror | None:
    """With a disk tier, this rank's files of its kv heads, in its own directory (server/tp/disk.py)."""
    disk = cfg.kv_cache_config.disk
    if disk is None or not init.num_disk:
        return None
    key = disk_tier_key(cfg.cache_transceiver_config.auth_token)
    return kv.mirror_disk(disk.for_rank(rank), key, init.num_disk)


class Worker:
    def __init__(self, args: WorkerArgs, end: RankEnd) -> None:
        self.end, self.rank = end, args.rank
        cfg = msgspec.json.decode(args.config_json, type=ServerConfig)
        self.device = device = group.rank_device(torch.device(args.device), args.rank)
        dtype = resolve_dtype(args.dtype, device)
        group.join(args.rank, args.size, device, port=args.store_port)
        spec = with_quantization(load_spec(args.model_dir), cfg.quantization)  # rank 0's fingerprint
        shard = RankShard.of(spec, args.rank, args.size, expert_parallel=cfg.expert_parallel_size > 1,
                             all_to_all=cfg.expert_dispatch == "all_to_all")
        weights = shard.load(spec, dtype, device, cfg.quantization)
        init, self.pending = self._init()
        layout = kv_cache_layout(cfg.kv_cache_config, shard.local_spec(spec), cfg.max_seq_len, dtype, device)
        self.kv = KVCacheManager(mirror_config(cfg.kv_cache_config, init, layout), layout, salt=spec.fingerprint)
        self.disk = mirror_disk(cfg, self.kv, init, args.rank)
        self.runner = ModelRunner(Path(args.model_dir), self.kv, dtype=dtype, device=device,
                                  max_num_tokens=cfg.max_num_tokens, max_batch_size=cfg.max_batch_size,
                                  tensors=weights, kernels=cfg.kernels, cuda_graphs=cfg.cuda_graphs,
                                  max_seq_len=cfg.max_seq_len, shard=shard)
        self.runner.warm_up()
        self.role = make_role(cfg, self.kv, spec.fingerprint, args.epoch, args.rank, shard.plan)
        end.report(Ready(args.rank, self.role.endpoint))

    def _init(self) -> tuple[Init, list[Op]]:
        command = self.end.receive(INIT_TIMEOUT_S)
        if command is None or not command.ops or not isinstance(command.ops[0], Init):
            raise RuntimeError("rank 0 sent no Init")
        return command.ops[0], command.ops[1:]

    def run(self) -> None:
        ops: list[Op] | None = self.pending
        while True:
            if ops and not self.apply(ops):
                self.role.close()
                if self.disk is not None:
                    self.disk.close()  # its queued writes land
                return
            for report in self.role.step():
                self.end.report(report)
            command: Command | None = self.end.receive(BUSY_POLL_S if self.role.busy else IDLE_POLL_S)
            ops = command.ops if command is not None else None

    def apply(self, ops: list[Op]) -> bool:
        """Run rank 0's operations in order; False on Stop."""
        for op in ops:
            if isinstance(op, Copies):
                self.copy(op)
            elif isinstance(op, CheckDisk):
                bad = self.disk.check(op.items) if self.disk is not None else \
                    dict.fromkeys(range(len(op.items)), ("missing", f"rank {self.rank} has no disk tier"))
                self.end.report(DiskChecked(self.rank, op.call, bad))
            elif isinstance(op, Forward):
                self.forward(op)
            elif isinstance(op, ShareLatent):
                share_latent(self.kv, op.wanted, self.rank)
            elif isinstance(op, Stop):
                return False
            else:
                self.role.apply(op)
        return True

    def copy(self, op: Copies) -> None:
        """Rank 0's copies on this rank's pools; its host -> disk copies write this rank's files."""
        if self.disk is not None:
            self.disk.before_copies(op.window, block_metas(op.disk_meta))
        self.kv.apply_copies(op.window, [CopyOp(Level(a), b, Level(c), d) for a, b, c, d in op.ops])
        if self.disk is not None:
            self.disk.after_copies(op.window)

    def forward(self, op: Forward) -> None:
        """This rank's part of one step; pending tokens come from the ids rank 0 broadcasts."""
        pending = None
        if op.pending is not None:
            sampled = torch.empty(op.num_sampled, dtype=torch.int64, device=self.device)
            pending = PendingTokens(group.share_from_rank0(sampled), op.pending)
        self.runner.execute(op.seqs, pending)
