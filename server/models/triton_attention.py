"""GPU attention backend: Triton kernels that read K/V through block tables (no per-step gather).

Per layer, `rope_write` rotates q and k and writes the new K/V into the cache, then decode rows run
the split-K paged decode (one launch); a prefill chunk with nothing cached before it and every key
in its window runs torch's fused causal SDPA over its own q/k/v; any other chunk runs the paged
prefill kernel. `plan` packs a step's indices into one int32 buffer uploaded in one copy;
`StaticDecodePlan` keeps them in static buffers for CUDA graphs (cuda_graphs.py).

An FP8 cache: K and V are stored as e4m3 of K / k_scale, V / v_scale and read back with the layer's
scales (fixed launch arguments a captured graph keeps); a dense prefill attends over the chunk's own
K/V before they are rounded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from kvcache.layout import inverse_scale
from server.models.attention import AttentionBackend, HostInts, PagedKV, SeqLayout, StepLayout
from server.models.dense_prefill import causal_sdpa, dense_prefill_kind
from server.models.kernels.attention import (
    decode_scratch,
    decode_splits,
    group_rows,
    paged_decode,
    paged_prefill,
    prefill_tokens_per_tile,
)
from server.models.kernels.elementwise import rope_write


@dataclass
class DecodeMeta:
    block_table: torch.Tensor  # [B, NB] int32 primary slots in token order (padding 0, never read)
    seq_lens: torch.Tensor  # [B] int32 keys in the cache including the new token (0: padding row)
    lo: torch.Tensor  # [B] int32 first key in the window
    splits: int
    scratch: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # graphs: preallocated


@dataclass
class PrefillMeta:
    block_table: torch.Tensor  # [S, NB] int32
    tiles: torch.Tensor  # [4, tiles] int32: sequence, first flattened row, first position, tokens
    lo_seq: torch.Tensor  # [S] int32 first key each sequence's chunk may see


@dataclass
class WindowMeta:
    slot: torch.Tensor  # [T] int32 slot of each new token (-1: padding, not written)
    offset: torch.Tensor  # [T] int32 position within the slot
    decode: DecodeMeta | None
    dense: list[slice]  # prefill chunks attended with SDPA over their own q/k/v
    paged: PrefillMeta | None


ALIGN_INTS = 4  # int32s per 16 bytes: Triton specialises a pointer argument on 16-byte alignment


def num_sms(device: torch.device) -> int:
    """The multiprocessors decode splits are sized for (4 on the CPU, where the interpreter runs)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


class TritonPagedAttention(AttentionBackend):
    def __init__(self, kv: PagedKV, num_layers: int, num_heads: int, head_dim: int, *,
                 max_seq_len: int) -> None:
        self.views = [kv.layer_cache(i) for i in range(num_layers)]  # (K, V) [slots, tpb, kv_heads, D]
        device = self.views[0][0].device
        self._shape(kv, num_layers, num_heads, self.views[0][0].shape[2], head_dim, head_dim**-0.5, max_seq_len,
                    device)
        self.scales = [kv.layout.format.layer_scales(i) for i in range(num_layers)]  # (k, v): 1.0 unless FP8
        self.inverse = [(inverse_scale(k), inverse_scale(v)) for k, v in self.scales]
        if head_dim & (head_dim - 1) or head_dim < 32:
            raise ValueError(f"the Triton backend needs a power-of-two head_dim >= 32, got {head_dim}")
        fp8 = self.views[0][0].dtype == torch.float8_e4m3fn
        if fp8 and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
            raise ValueError("an FP8 KV cache needs a GPU of compute capability 8.9 or later (Ada, Hopper) for "
                             "the Triton kernels (kernels: torch serves it on any GPU)")

    def _shape(self, kv: PagedKV, num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
               max_seq_len: int, device: torch.device) -> None:
        """What the plans and kernels read (the latent backend's too: one kv head, head_dim its rank)."""
        self.kv, self.tpb, self.scale = kv, kv.tokens_per_block, scale
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.windows = [kv.layer_window(i) for i in range(num_layers)]
        self.max_blocks = math.ceil(max_seq_len / self.tpb)
        self.device, self.num_sms = device, num_sms(device)

    def plan(self, layout: StepLayout, positions: torch.Tensor) -> dict[int, WindowMeta]:
        ints = HostInts(torch.int32, ALIGN_INTS)
        host = {w: self._host_window(layout, w, ints) for w in self.kv.window_sizes}
        dev = ints.upload(self.device)
        return {w: make(dev) for w, make in host.items()}

    def _host_window(self, layout: StepLayout, window: int, ints: HostInts):
        seqs, nd = layout.seqs, layout.num_decode
        slots, offsets = _write_locations(seqs, window, self.tpb)
        at_slot, at_off = ints.add(slots), ints.add(offsets)
        decode = self._host_decode(seqs[:nd], window, ints) if nd else None
        dense, paged_seqs, row = [], [], nd
        for seq in seqs[nd:]:
            rows = slice(row, row + seq.num_new)
            if seq.num_past == 0 and seq.num_new <= window and dense_prefill_kind() != "triton":
                dense.append(rows)
            else:
                paged_seqs.append((seq, row))
            row += seq.num_new
        paged = self._host_prefill(paged_seqs, window, ints) if paged_seqs else None

        def make(dev: torch.Tensor) -> WindowMeta:
            return WindowMeta(dev[at_slot], dev[at_off], decode(dev) if decode else None, dense,
                              paged(dev) if paged else None)

        return make

    def _host_decode(self, seqs: list[SeqLayout], window: int, ints: HostInts):
        lens = [s.num_past + 1 for s in seqs]
        nb = max(math.ceil(n / self.tpb) for n in lens)
        table = _padded_tables(seqs, window, nb)
        spans = [ints.add(table), ints.add(lens), ints.add([max(0, n - window) for n in lens])]
        splits = decode_splits(len(seqs), self.num_kv_heads, self.num_sms)
        b = len(seqs)

        def make(dev: torch.Tensor) -> DecodeMeta:
            t, n, lo = (dev[span] for span in spans)
            return DecodeMeta(t.view(b, nb), n, lo, splits)

        return make

    def _host_prefill(self, seqs: list[tuple[SeqLayout, int]], window: int, ints: HostInts):
        per_tile = prefill_tokens_per_tile(self.num_heads, self.num_kv_heads)
        nb = max(math.ceil((s.num_past + s.num_new) / self.tpb) for s, _ in seqs)
        table = _padded_tables([s for s, _ in seqs], window, nb)
        tiles: list[list[int]] = [[], [], [], []]
        for index, (seq, row) in enumerate(seqs):
            for t0 in range(0, seq.num_new, per_tile):
                for column, value in zip(tiles, (index, row + t0, seq.num_past + t0,
                                                 min(per_tile, seq.num_new - t0)), strict=True):
                    column.append(value)
        num_tiles = len(tiles[0])
        width = num_tiles + (-num_tiles % ALIGN_INTS)  # each column starts 16-byte aligned
        spans = [ints.add(table), ints.add([v for column in tiles for v in column + [0] * (width - num_tiles)]),
                 ints.add([max(0, s.num_past - window + 1) for s, _ in seqs])]
        n = len(seqs)

        def make(dev: torch.Tensor) -> PrefillMeta:
            t, tl, lo = (dev[span] for span in spans)
            return PrefillMeta(t.view(n, nb), tl.view(4, width)[:, :num_tiles], lo)

        return make

    def forward(self, layer: int, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: dict[int, WindowMeta]) -> torch.Tensor:
        k_cache, v_cache = self.views[layer]
        window = self.windows[layer]
        plan = meta[window]
        heads, kv_heads = self.num_heads, self.num_kv_heads
        (k_scale, v_scale), (k_inv, v_inv) = self.scales[layer], self.inverse[layer]
        rope_write(qkv, cos, sin, k_cache, v_cache, plan.slot, plan.offset, heads, kv_heads, k_inv, v_inv)
        q = qkv[:, :heads]
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if plan.decode is not None:
            d = plan.decode
            nd = d.seq_lens.shape[0]
            paged_decode(q[:nd], k_cache, v_cache, d.block_table, d.seq_lens, d.lo, out[:nd], self.scale,
                         d.splits, d.scratch, k_scale, v_scale)
        for rows in plan.dense:
            out[rows] = causal_sdpa(qkv[rows], heads, kv_heads, self.scale)
        if plan.paged is not None:
            p = plan.paged
            paged_prefill(q, k_cache, v_cache, out, p.block_table, p.tiles, p.lo_seq, self.scale, window,
                          k_scale, v_scale)
        return out


class StaticDecodePlan:
    """A decode-only plan for `batch` rows whose tensors never move: `fill` rewrites them (one copy)
    before each replay; rows past the real batch are padding. A replay computes the logits of
    `logit_rows` rows (default batch), which ones `fill` says."""

    def __init__(self, backend: TritonPagedAttention, batch: int, logit_rows: int | None = None) -> None:
        self.backend, self.batch = backend, batch
        self.num_logit_rows = batch if logit_rows is None else logit_rows
        windows, nb = backend.kv.window_sizes, backend.max_blocks
        # per window: slot, offset, seq_len, lo [batch] and block table [batch, nb]; then tokens,
        # positions, picks [batch], and the rows whose logits are computed [logit_rows]
        self.per_window = 4 * batch + batch * nb
        size = len(windows) * self.per_window + 3 * batch + self.num_logit_rows
        cuda = backend.device.type == "cuda"
        # two pinned staging buffers in turn, each with the event of its last upload: async scheduling
        # fills step k+1 while step k's upload may still be queued; the other buffer's upload came
        # before a step the engine has waited for, so its event is done and the check never waits
        self._staging = [torch.zeros(size, dtype=torch.int32, pin_memory=cuda) for _ in range(2)]
        self._uploaded = [torch.cuda.Event() for _ in range(2)] if cuda else None
        self._turn = 0
        self.dev = torch.zeros(size, dtype=torch.int32, device=backend.device)
        splits = decode_splits(batch, backend.num_kv_heads, backend.num_sms)
        gp = group_rows(backend.num_heads, backend.num_kv_heads)
        self.meta: dict[int, WindowMeta] = {}
        for i, window in enumerate(windows):
            base = i * self.per_window
            part = lambda k, base=base: self.dev[base + k * batch: base + (k + 1) * batch]  # noqa: E731
            table = self.dev[base + 4 * batch: base + self.per_window].view(batch, nb)
            scratch = decode_scratch(batch, backend.num_kv_heads, gp, backend.head_dim, splits, backend.device)
            self.meta[window] = WindowMeta(part(0), part(1), DecodeMeta(table, part(2), part(3), splits, scratch),
                                           [], None)
        tail = len(windows) * self.per_window
        self.token_ids = self.dev[tail: tail + batch]
        self.positions = self.dev[tail + batch: tail + 2 * batch]
        self.picks = self.dev[tail + 2 * batch: tail + 3 * batch]  # row of `take_pending`'s source, -1: none
        self.logit_rows = self.dev[tail + 3 * batch:]
        self.fill([], [])  # every row padding: a warm-up or capture run writes no slot

    def fill(self, seqs: list[SeqLayout], token_ids: list[int], picks: list[int] | None = None,
             logit_rows: list[int] | None = None) -> None:
        """Write one decode step (len(seqs) <= batch) into a pinned staging buffer, then one
        asynchronous copy. `picks[i] >= 0`: row i's token is `take_pending`'s source[picks[i]].
        `logit_rows`: the rows whose logits the replay returns (default: the first ones)."""
        b, nb, tpb = self.batch, self.backend.max_blocks, self.backend.tpb
        n = len(seqs)
        self._turn ^= 1
        staging = self._staging[self._turn]
        if self._uploaded is not None and not self._uploaded[self._turn].query():
            self._uploaded[self._turn].synchronize()  # only if the engine ran ahead of its discipline
        host = staging.numpy()
        lens = np.fromiter((s.num_past + 1 for s in seqs), dtype=np.int32, count=n)
        for i, window in enumerate(self.backend.kv.window_sizes):
            part = host[i * self.per_window:(i + 1) * self.per_window]
            slot, offset, seq_len, lo = (part[k * b:(k + 1) * b] for k in range(4))
            table = part[4 * b:].reshape(b, nb)
            table[:] = 0
            for row, seq in enumerate(seqs):
                slots = seq.slot_tables[window][:nb]
                table[row, :len(slots)] = slots
            np.maximum(table, 0, out=table)  # -1 (released below the window) is never read
            pos = lens - 1
            slot[:n] = table[np.arange(n), pos // tpb]
            slot[n:] = -1
            offset[:n], offset[n:] = pos % tpb, 0
            seq_len[:n], seq_len[n:] = lens, 0
            lo[:n], lo[n:] = np.maximum(lens - window, 0), 0
        tail = host[len(self.backend.kv.window_sizes) * self.per_window:]
        tail[:n], tail[n:b] = token_ids, 0
        tail[b:b + n], tail[b + n:2 * b] = lens - 1, 0
        tail[2 * b:2 * b + n], tail[2 * b + n:3 * b] = picks if picks is not None else -1, -1
        wanted = range(min(n, self.num_logit_rows)) if logit_rows is None else logit_rows
        out = tail[3 * b:]
        out[:len(wanted)], out[len(wanted):] = wanted, 0
        self.dev.copy_(staging, non_blocking=True)
        if self._uploaded is not None:
            self._uploaded[self._turn].record()

    def take_pending(self, source: torch.Tensor) -> None:
        """Device side of `fill`'s picks, captured in the graph: a row with a pick takes its token from
        `source` (the previous step's sampled ids)."""
        picked = source.index_select(0, self.picks.clamp(min=0)).to(torch.int32)
        self.token_ids.copy_(torch.where(self.picks >= 0, picked, self.token_ids))


def _write_locations(seqs: list[SeqLayout], window: int, tpb: int) -> tuple[list[int], list[int]]:
    slots, offsets = [], []
    for seq in seqs:
        table = seq.slot_tables[window]
        for pos in range(seq.num_past, seq.num_past + seq.num_new):
            slots.append(table[pos // tpb])
            offsets.append(pos % tpb)
    return slots, offsets


def _padded_tables(seqs: list[SeqLayout], window: int, nb: int) -> list[int]:
    """Flattened [len(seqs), nb] slot tables; -1 (released) and missing entries become 0: the
    kernels never read a key outside [lo, len), so those entries are never used."""
    out: list[int] = []
    for seq in seqs:
        table = seq.slot_tables[window][:nb]
        out += [max(s, 0) for s in table] + [0] * (nb - len(table))
    return out
