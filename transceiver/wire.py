"""The KV link's wire (context sender <-> generation receiver): the messages, their codec (`link_codec`,
sealed by transceiver/signed.py) and the KV layout both sides must share. Never pickle.

A message is `[header, mac, *payload]` (a ROUTER adds the peer identity in front); only `ChunkHeader`
carries payload frames (raw KV bytes, under their own checksum). A failed check raises `Rejected`.

Same GPU (ipc.py): `InstanceInfo.ipc` offers the pools, pulls go `via_ipc`, answered by `IpcChunk`s;
the defaults of those fields keep the previous version on bytes. Tensor parallelism (tp.py):
`Layout` names a rank's kv heads, rank 0's `InstanceInfo.ranks` lists every rank, `PullRequest.heads`
asks for some, and with several ranks on a side pulls `keep_lease` until the `Release`.
"""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING

import msgspec

from transceiver.signed import SignedCodec

if TYPE_CHECKING:
    import torch

    from kvcache import KVCacheManager

PROTOCOL_VERSION = 2

# Reasons carried by `Failed.reason` and used as the label of failure counters (a closed set).
REASONS = (
    "timeout",  # the pull did not finish within kv_transfer_timeout_ms
    "epoch_mismatch",  # the context server restarted since the request was prefilled
    "incompatible",  # the two servers' KV layouts or models differ
    "unknown_request",  # no lease for ctx_request_id (never existed, expired, or released)
    "bad_request",  # the pull asks for blocks the lease does not hold
    "out_of_blocks",  # the sender could not bring offloaded blocks back to its primary pool
    "integrity",  # a chunk's byte count or checksum did not match
    "lease_expired",  # the lease ended while its transfer was running
    "peer_gone",  # the other side disconnected or shut down
    "cancelled",  # the receiver cancelled
    "internal_error",  # the sender hit an unexpected error serving the pull (logged there)
    "remote_error",  # the peer sent a reason this version does not know
)


class WindowLayout(msgspec.Struct, frozen=True):
    """One window group's pool: blocks move as they are, so both sides must share layout, dtype and
    FP8 per-layer scales (in `layers` order; empty in the model's dtype)."""

    window: int
    layers: list[int]
    kv_heads: int
    head_dim: int
    dtype: str
    slot_bytes: int
    k_scales: list[float] = []
    v_scales: list[float] = []
    kv_layout: str = "heads"  # KVFormat.layout: "heads" or "latent"


class Layout(msgspec.Struct, frozen=True):
    """What must agree between the two servers before any KV byte moves."""

    tokens_per_block: int
    windows: list[WindowLayout]
    fingerprint: str  # model identity (the caller's choice, e.g. a hash of the model config)
    kv_heads_total: int = 0  # the model's kv heads (0: those of `windows`, one rank holds them all)
    kv_head_start: int = 0  # the first of them this rank's pools hold (`windows[i].kv_heads` in all)

    @property
    def total_heads(self) -> int:
        return self.kv_heads_total or self.windows[0].kv_heads

    @property
    def heads(self) -> tuple[int, int]:
        """[start, end) of the model's kv heads this rank holds."""
        return self.kv_head_start, self.kv_head_start + self.windows[0].kv_heads


class RankEndpoint(msgspec.Struct, frozen=True):
    """One rank of a tensor-parallel context server: its KV endpoint and the kv heads it holds."""

    endpoint: str
    kv_heads: tuple[int, int]  # [start, end) of the model's kv heads


NODE_ID_ENV = "PDSERVE_NODE_ID"  # set by server/deploy/ray/ for the server processes it places


def node_name() -> str:
    """This machine for the same-GPU decision: `ray:<node id>` under Ray (two Ray nodes on one host
    are two machines to it), else the hostname."""
    node = os.environ.get(NODE_ID_ENV)
    return f"ray:{node}" if node else socket.gethostname()


class PeerIdentity(msgspec.Struct, frozen=True):
    """Where a process's primary pools live (CUDA pools only)."""

    hostname: str  # node_name(): Ray's node id under Ray
    boot_id: str  # /proc/sys/kernel/random/boot_id: a reboot or another kernel gives another id
    gpu_uuid: str  # torch.cuda.get_device_properties(i).uuid: the same GPU whatever its index
    pid: int

    def shares_gpu_with(self, other: PeerIdentity) -> bool:
        """Another process (CUDA IPC cannot open its own export) on the same booted host and GPU."""
        return (self.hostname, self.boot_id, self.gpu_uuid) == (other.hostname, other.boot_id, other.gpu_uuid) \
            and self.pid != other.pid


class CudaIpcPool(msgspec.Struct, frozen=True):
    """One window group's primary pool (contiguous, at its storage's start). The eight fields after
    `num_slots` are `UntypedStorage._share_cuda_()`'s tuple, raw and in order (as in
    torch/multiprocessing/reductions.py; run on torch 2.11, read in 2.13's source), for
    `_new_shared_cuda(*fields)` on the receiver (with its own index of the GPU as `device`)."""

    window: int
    num_slots: int
    device: int  # the sender's CUDA index (the receiver's index of that GPU may differ)
    handle: bytes  # cudaIpcMemHandle_t of the allocation (or torch's expandable-segment handle)
    storage_size_bytes: int
    storage_offset_bytes: int  # of the storage in that allocation
    ref_counter_handle: bytes  # name of the sender's shared-memory ref-counter file
    ref_counter_offset: int
    event_handle: bytes  # cudaIpcEventHandle_t recorded when the pool was exported
    event_sync_required: bool


class IpcOffer(msgspec.Struct, frozen=True):
    """The sender's pools, readable by a receiver on the same GPU."""

    identity: PeerIdentity
    pools: list[CudaIpcPool]


class Hello(msgspec.Struct, tag=True, frozen=True):
    """gen -> ctx, once per (endpoint, epoch): the receiver's layout (and where its CUDA pools are)."""

    layout: Layout
    identity: PeerIdentity | None = None
    open_epoch: str | None = None  # the sender epoch whose pools this receiver holds open already


class InstanceInfo(msgspec.Struct, tag=True, frozen=True):
    """ctx -> gen, answer to Hello (its epoch is the envelope's). `ipc`: a fresh export, when the
    Hello's identity shares the GPU and its open_epoch is not the sender's epoch."""

    layout: Layout
    ipc: IpcOffer | None = None
    ranks: list[RankEndpoint] = []  # rank 0 of a tensor-parallel server: every rank; else empty


class WindowRange(msgspec.Struct, frozen=True):
    """Blocks [first, first + count) of one window group's block list of the request."""

    window: int
    first: int
    count: int

    def split(self, most: int) -> list[WindowRange]:
        """The range as consecutive ranges of at most `most` blocks."""
        end = self.first + self.count
        return [WindowRange(self.window, first, min(most, end - first)) for first in range(self.first, end, most)]


class PullRequest(msgspec.Struct, tag=True, frozen=True):
    """gen -> ctx: send these blocks of the leased request."""

    pull_id: int
    ctx_request_id: str
    ctx_epoch: str
    ranges: list[WindowRange]
    via_ipc: bool = False  # answer with IpcChunks (only after an InstanceInfo with `ipc` of this epoch)
    heads: tuple[int, int] | None = None  # [start, end) of the sender's own kv heads to send; None: all
    keep_lease: bool = False  # this pull's Ack ends the pull only; the lease ends with `Release`
    stream: bool = False  # a lease still prefilling: waited for, sent as written; Done has the first token


class ChunkHeader(msgspec.Struct, tag=True, frozen=True):
    """ctx -> gen: `count` blocks of `window` from `first`, back to back in whole-block frames (one
    block over `max_chunk_bytes`: count == 1, cut in several); `checksum`: `payload.checksum`."""

    pull_id: int
    window: int
    first: int
    count: int
    nbytes: int
    checksum: int


class IpcChunk(msgspec.Struct, tag=True, frozen=True):
    """ctx -> gen, CUDA IPC's ChunkHeader: blocks [first, first + len(slots)) of `window` are in
    these slots of the offered pool, written and pinned until the Ack; `checksum` of their bytes."""

    pull_id: int
    window: int
    first: int
    slots: list[int]
    checksum: int


class Done(msgspec.Struct, tag=True, frozen=True):
    """ctx -> gen: every chunk was sent (streamed: with the first token(s) and the prefix hit)."""

    pull_id: int
    total_bytes: int
    chunks: int
    first_tokens: list[int] = []
    cached_tokens: int = 0


class Ack(msgspec.Struct, tag=True, frozen=True):
    """gen -> ctx: the blocks were written into the receiver's slots; the lease can go."""

    pull_id: int
    ctx_request_id: str


class Cancel(msgspec.Struct, tag=True, frozen=True):
    """gen -> ctx: drop the lease now (request aborted or rejected before or during its pull)."""

    ctx_request_id: str
    pull_id: int | None = None
    ctx_epoch: str | None = None  # when set, a sender with another epoch ignores the message


class Release(msgspec.Struct, tag=True, frozen=True):
    """gen -> ctx (rank 0): every rank's part of the request's KV arrived; the lease ends."""

    ctx_request_id: str
    ctx_epoch: str


class Failed(msgspec.Struct, tag=True, frozen=True):
    """Either direction: the pull (or, with pull_id None, the handshake) failed."""

    reason: str
    detail: str
    pull_id: int | None = None


Body = Hello | InstanceInfo | PullRequest | ChunkHeader | IpcChunk | Done | Ack | Cancel | Release | Failed


def layout_mismatch(ctx: Layout, gen: Layout) -> str | None:
    """None when compatible, else what differs (tensor-parallel ranks may hold different kv heads)."""
    if ctx.fingerprint != gen.fingerprint:
        return f"model fingerprint differs: context {ctx.fingerprint!r} vs generation {gen.fingerprint!r}"
    if ctx.tokens_per_block != gen.tokens_per_block:
        return (f"tokens_per_block differs: context {ctx.tokens_per_block} "
                f"vs generation {gen.tokens_per_block}")
    ctx_w = {w.window: w for w in ctx.windows}
    gen_w = {w.window: w for w in gen.windows}
    if sorted(ctx_w) != sorted(gen_w):
        return f"window groups differ: context {sorted(ctx_w)} vs generation {sorted(gen_w)}"
    if ctx.total_heads != gen.total_heads:
        return f"the model's kv_heads differs: context {ctx.total_heads} vs generation {gen.total_heads}"
    for window in sorted(ctx_w):
        problem = _window_mismatch(ctx_w[window], gen_w[window])
        if problem is not None:
            return f"window {window}: {problem}"
    return None


def _window_mismatch(a: WindowLayout, b: WindowLayout) -> str | None:
    for name in ("kv_layout", "layers", "head_dim", "dtype", "k_scales", "v_scales"):
        if getattr(a, name) != getattr(b, name):
            return f"{name} differs: context {getattr(a, name)!r} vs generation {getattr(b, name)!r}"
    if a.kv_heads == b.kv_heads and a.slot_bytes != b.slot_bytes:
        return f"slot_bytes differs: context {a.slot_bytes!r} vs generation {b.slot_bytes!r}"
    if a.slot_bytes * b.kv_heads != b.slot_bytes * a.kv_heads:
        return (f"bytes per kv head differ: context {a.slot_bytes} for {a.kv_heads} heads vs generation "
                f"{b.slot_bytes} for {b.kv_heads}")
    return None


def layout_of(kv: KVCacheManager, pools: dict[int, torch.Tensor], fingerprint: str,
              heads: tuple[int, int] | None = None) -> Layout:
    """The layout a server advertises for its primary `pools`; `heads`: a TP rank's (first held, total)."""
    windows, fmt = [], kv.layout.format
    for w in sorted(kv.window_sizes):
        layers = list(kv.group_layers(w))
        k_scales = [fmt.k_scales[i] for i in layers] if fmt.quantized else []
        v_scales = [fmt.v_scales[i] for i in layers] if fmt.v_scales else []
        windows.append(WindowLayout(window=w, layers=layers, kv_heads=int(pools[w].shape[4]),
                                    head_dim=int(pools[w].shape[5]), dtype=str(fmt.dtype).removeprefix("torch."),
                                    slot_bytes=kv.slot_bytes(w), k_scales=k_scales, v_scales=v_scales,
                                    kv_layout=fmt.layout))
    start, total = heads if heads is not None else (0, 0)
    return Layout(tokens_per_block=kv.tokens_per_block, windows=windows, fingerprint=fingerprint,
                  kv_heads_total=total, kv_head_start=start)


# ---- sealing and opening (transceiver/signed.py)

MAX_HEADER_BYTES = 64 * 1024  # a header is a few hundred bytes; anything larger is garbage
TO_SENDER, TO_RECEIVER = "to-sender", "to-receiver"


def link_codec(token: bytes, epoch: str, *, sender: bool) -> SignedCodec:
    """The sender's or receiver's end of the KV link: fresh, first-seen messages, a key per direction."""
    sends, receives = (TO_RECEIVER, TO_SENDER) if sender else (TO_SENDER, TO_RECEIVER)
    return SignedCodec(token, "kv-link", sends, receives, Body, epoch=epoch, version=PROTOCOL_VERSION,
                       fresh=True, max_bytes=MAX_HEADER_BYTES)
