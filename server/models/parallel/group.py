"""The torch.distributed process group of one server's ranks (all on one host).

Rank 0 opens the rendezvous store on a free loopback port (`open_store`) before it starts the other
ranks and hands them the port; every rank then `join`s: NCCL on CUDA (rank r on cuda:r), gloo on the
CPU. Every collective is bounded by `timeout_s`, so a rank that stops answering fails the others'
next collective instead of hanging them for ever.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

HOST = "127.0.0.1"
DEFAULT_TIMEOUT_S = 300.0


def rank_device(device: torch.device, rank: int) -> torch.device:
    """The device of `rank`: cuda:rank for a CUDA server (one GPU per rank), else the CPU."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


def open_store(size: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> dist.TCPStore:
    """Rank 0: the rendezvous store, on a free port (`store.port`)."""
    return dist.TCPStore(HOST, 0, size, is_master=True, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def join(rank: int, size: int, device: torch.device, *, port: int | None = None,
         store: dist.TCPStore | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Join the server's group as `rank` (rank 0 passes the store it opened, the others its port)."""
    if store is None:
        store = dist.TCPStore(HOST, port, size, is_master=False, timeout=timedelta(seconds=timeout_s))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank, world_size=size,
                            timeout=timedelta(seconds=timeout_s),
                            device_id=device if device.type == "cuda" else None)


def share_from_rank0(tensor: torch.Tensor) -> torch.Tensor:
    """Rank 0's `tensor` on every rank, in place (every rank calls it, with one of the same shape and
    dtype on its own device). On CUDA only the stream waits for it, not the host."""
    dist.broadcast(tensor, src=0)
    return tensor


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
