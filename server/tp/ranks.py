"""Rank 0's handle on the other ranks of its server: start them, keep them in step, stop them.

`Ranks.start` spawns ranks 1..N-1 ("spawn": nothing forked after torch or CUDA started) and joins the
process group. Rank 0 queues every operation the ranks must mirror and sends the queue in order as
one `Command` (`flush`) before each forward, lease or pull. A watchdog ends this process with
RANK_DIED_EXIT when a rank dies, so the launcher restarts the whole server.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import secrets
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import msgspec
import torch

from kvcache import KVCacheManager, Level
from kvcache.block import CopyOp
from server.config.schema import ServerConfig
from server.models.model_spec import ModelSpec
from server.models.parallel import group
from server.models.parallel.context import RankShard
from server.tp import worker
from server.tp.channel import ChannelError, RootEnd
from server.tp.disk import DiskChecks, disk_metas
from server.tp.messages import Command, Copies, Failure, Init, Joined, Op, Ready, Report, Stop

log = logging.getLogger(__name__)

RANK_DIED_EXIT = 3  # the server's exit code when one of its ranks died
START_TIMEOUT_S = 600.0  # a rank loads its shard and warms up within this
STOP_TIMEOUT_S = 10.0


class RankFailed(RuntimeError):
    pass


class Ranks:
    def __init__(self, size: int, end: RootEnd, procs: list[multiprocessing.Process], epoch: str,
                 on_rank_death: Callable[[], None]) -> None:
        self.size = size
        self.epoch = epoch  # the KV senders' epoch, the same on every rank of a context server
        self._end = end
        self._procs = procs
        self._ops: list[Op] = []
        self._reports: list[Report] = []
        self._stopping = False
        self.kv_endpoints: list[str | None] = [None] * size  # per rank, from `Ready`
        self.shard: RankShard | None = None  # rank 0's part of the model
        self._kv: KVCacheManager | None = None  # rank 0's, once attached
        self.device = torch.device("cpu")  # rank 0's
        self._on_rank_death = on_rank_death
        threading.Thread(target=self._watch, name="pdserve-rank-watchdog", daemon=True).start()

    @classmethod
    def start(cls, config_json: bytes, model_dir: str, size: int, device: torch.device, dtype: torch.dtype,
              on_rank_death: Callable[[], None] = lambda: os._exit(RANK_DIED_EXIT)) -> Ranks:
        """Spawn ranks 1..size-1 and join the process group as rank 0; `on_rank_death()` runs once the
        other ranks are killed after one died (default: end this process)."""
        secret, epoch = secrets.token_bytes(32), uuid.uuid4().hex
        end = RootEnd(secret)
        store = group.open_store(size)
        spawn = multiprocessing.get_context("spawn")
        procs = []
        for rank in range(1, size):
            args = worker.WorkerArgs(config_json=config_json, model_dir=model_dir, rank=rank, size=size,
                                     store_port=store.port, channel=end.endpoint, secret=secret.hex(),
                                     epoch=epoch, device=str(device), dtype=str(dtype).removeprefix("torch."))
            procs.append(spawn.Process(target=worker.main, args=(msgspec.msgpack.encode(args),), daemon=True,
                                       name=f"pdserve-rank-{rank}"))
            procs[-1].start()
        ranks = cls(size, end, procs, epoch, on_rank_death)
        group.join(0, size, group.rank_device(device, 0), store=store)
        ranks.wait_for(Joined)
        return ranks

    def attach(self, kv: KVCacheManager) -> None:
        """Give the ranks the pools' slot counts and mirror every copy (and disk check) `kv` runs from now on."""
        window = kv.window_sizes[0]
        num_disk = kv.num_slots(window, Level.DISK)
        self._kv = kv
        kv.observe_copies(self._on_copies)
        if num_disk:
            kv.share_disk_checks(DiskChecks(self, kv.config.disk.io_timeout_s))
        self.flush(Init(kv.num_slots(window, Level.PRIMARY), kv.num_slots(window, Level.SECONDARY), num_disk))

    def _on_copies(self, window: int, ops: list[CopyOp]) -> None:
        metas = disk_metas(self._kv, window, ops) if self._kv is not None else []
        self._ops.append(Copies(window, [(int(a), b, int(c), d) for a, b, c, d in ops], metas))

    def flush(self, *ops: Op) -> None:
        """Queue `ops`, then send the queue in order to every rank; a rank that does not take it ends the server."""
        self._ops += ops
        if self._ops:
            ops, self._ops = self._ops, []
            try:
                self._end.send(list(range(1, self.size)), Command(ops))
            except ChannelError as exc:
                log.error("%s: stopping every rank of this server (exit %d)", exc, RANK_DIED_EXIT)
                self._kill_all()

    def _kill_all(self) -> None:
        self._stopping = True  # the watchdog does not report the kills below
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        self._on_rank_death()

    def wait_for(self, kind: type[Joined] | type[Ready], timeout_s: float = START_TIMEOUT_S) -> None:
        """Block until every rank has sent its `kind` report (`Ready`: loaded and warmed up)."""
        found = self.collect(lambda r: isinstance(r, kind), timeout_s)
        missing = sorted(set(range(1, self.size)) - set(found))
        if missing:
            raise RankFailed(f"ranks {missing} sent no {kind.__name__} within {timeout_s:.0f} s")
        for rank, report in found.items():
            if isinstance(report, Ready):
                self.kv_endpoints[rank] = report.kv_endpoint

    def collect(self, wanted: Callable[[Report], bool], timeout_s: float) -> dict[int, Report]:
        """The first `wanted` report of each other rank, waiting at most `timeout_s` for them all
        (a rank missing from the answer sent none in time); other reports stay for `reports`."""
        deadline = time.monotonic() + timeout_s
        found: dict[int, Report] = {}
        others: list[Report] = []
        while len(found) < self.size - 1 and time.monotonic() <= deadline:
            for report in self.reports(min(0.1, max(0.0, deadline - time.monotonic()))):
                if wanted(report) and report.rank not in found:  # type: ignore[union-attr]
                    found[report.rank] = report  # type: ignore[union-attr]
                else:
                    others.append(report)
        self._reports = others + self._reports
        return found

    def reports(self, timeout_s: float = 0.0) -> list[Report]:
        """Reports that arrived (pulls' parts); a rank's `Failure` raises RankFailed."""
        for report in self._end.receive(timeout_s):
            if isinstance(report, Failure):
                raise RankFailed(f"rank {report.rank} failed: {report.error}")
            self._reports.append(report)
        out, self._reports = self._reports, []
        return out

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Ask every rank to stop, wait for them (then kill), close the channel."""
        self._stopping = True
        try:
            self._end.send(list(range(1, self.size)), Command([Stop()]))
        except ChannelError as exc:
            log.warning("could not ask the ranks to stop: %s", exc)
        deadline = time.monotonic() + timeout_s
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(1.0)
        self._end.close()
        group.leave()

    def _watch(self) -> None:
        procs = {p.sentinel: p for p in self._procs}
        ready = multiprocessing.connection.wait(list(procs))
        if self._stopping:
            return
        dead = procs[ready[0]]
        dead.join(1.0)  # its exit code
        log.error("%s exited with code %s: stopping every rank of this server (exit %d)", dead.name,
                  dead.exitcode, RANK_DIED_EXIT)
        self._kill_all()


def start_ranks(cfg: ServerConfig, model_dir: Path, spec: ModelSpec, device: torch.device,
                dtype: torch.dtype) -> Ranks:
    """Start the other ranks of the server `cfg` describes; rank 0 (this process) gets its shard."""
    size = cfg.tensor_parallel_size
    ranks = Ranks.start(msgspec.json.encode(cfg), str(model_dir), size, device, dtype)
    ranks.device = group.rank_device(device, 0)
    ranks.shard = RankShard.of(spec, 0, size, expert_parallel=cfg.expert_parallel_size > 1,
                               all_to_all=cfg.expert_dispatch == "all_to_all")
    return ranks
