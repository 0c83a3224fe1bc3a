"""Paged attention over a flattened (varlen) batch: the backend interface and a portable torch backend.

The runner lays a step out as `StepLayout`: decode sequences (one query each) first, then prefill
chunks, all tokens in one flattened batch of T rows. A backend turns the layout into per-window
metadata ONCE per step (`plan`), then every layer calls `forward` with its q/k/v:

1. write the new K/V into the layer's cache at (slot, offset) of each token's position;
2. read each sequence's context back through its block table (primary slots) and attend, with a
   causal + sliding-window mask: a query at position p sees keys k with p - window < k <= p.

No host synchronisation in `forward`: every index and mask is a tensor built in `plan` from host
lists, and Python branches only on host-known sizes. Pools are zero-initialised, so padded or
masked slots never inject NaN.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


class PagedKV(Protocol):
    """What attention needs from the KV cache manager (`kvcache.KVCacheManager` provides it)."""

    tokens_per_block: int
    window_sizes: tuple[int, ...]

    def layer_cache(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer, each [num_primary_slots, tokens_per_block, kv_heads, head_dim] (views)."""
        ...

    def layer_window(self, layer_idx: int) -> int: ...


@dataclass(frozen=True)
class SeqLayout:
    """One sequence of the step (host data)."""

    num_past: int  # tokens already in the cache; the chunk's positions start here
    num_new: int  # tokens computed this step (1 for decode)
    slot_tables: dict[int, list[int]]  # window -> primary slot of each block, token order; -1 = released


@dataclass(frozen=True)
class StepLayout:
    """The flattened batch: `seqs[:num_decode]` have one token each, the rest are prefill chunks."""

    seqs: list[SeqLayout]
    num_decode: int

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new for s in self.seqs)


class AttentionBackend(ABC):
    """Attention for one model: `plan` once per step, then `forward` per layer with that plan."""

    @abstractmethod
    def plan(self, layout: StepLayout, positions: torch.Tensor) -> object:
        """Metadata for the step; `positions` [T] int64 on the device, in flattened order."""

    @abstractmethod
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: object) -> torch.Tensor:
        """q [T, heads, head_dim], k/v [T, kv_heads, head_dim] -> attention output [T, heads, head_dim]."""


@dataclass
class _Prefill:
    rows: slice  # rows of the flattened batch
    slots: torch.Tensor  # [num_blocks] int64, the blocks holding keys this chunk may see
    mask: torch.Tensor  # [num_new, num_blocks * tpb] bool, True = attend


@dataclass
class _WindowPlan:
    """Shared by every layer of one window group for one step."""

    write_slots: torch.Tensor  # [T] int64 primary slot of each new token
    write_offsets: torch.Tensor  # [T] int64 offset inside the block
    decode_slots: torch.Tensor | None  # [num_decode * blocks] int64 (padding: slot 0, masked)
    decode_mask: torch.Tensor | None  # [num_decode, 1, 1, blocks * tpb] bool
    prefills: list[_Prefill]


class TorchPagedAttention(AttentionBackend):
    """Portable backend (CPU and CUDA): gathers blocks with index_select, attends with SDPA."""

    def __init__(self, kv: PagedKV, num_layers: int, num_heads: int, head_dim: int) -> None:
        self.kv = kv
        self.tpb = kv.tokens_per_block
        self.num_heads = num_heads
        self.scale = head_dim**-0.5
        # per layer (window, K view, V view); the manager allocates its pools once, so views stay valid
        self.layers = [(kv.layer_window(i), *kv.layer_cache(i)) for i in range(num_layers)]

    # ---- per step
    def plan(self, layout: StepLayout, positions: torch.Tensor) -> dict[int, _WindowPlan]:
        return {w: self._plan_window(layout, positions, w) for w in self.kv.window_sizes}

    def _plan_window(self, layout: StepLayout, positions: torch.Tensor, window: int) -> _WindowPlan:
        decode_slots = decode_mask = None
        nd = layout.num_decode
        if nd:
            decode_slots, decode_mask = self._plan_decode(layout.seqs[:nd], positions[:nd], window)
        prefills, row = [], nd
        for seq in layout.seqs[nd:]:
            rows = slice(row, row + seq.num_new)
            prefills.append(self._plan_prefill(seq, positions[rows], rows, window))
            row += seq.num_new
        # after the span checks above: every new token's block is present
        ws, wo = _write_indices(layout.seqs, window, self.tpb)
        write_slots = torch.tensor(ws, dtype=torch.int64).to(positions.device, non_blocking=True)
        write_offsets = torch.tensor(wo, dtype=torch.int64).to(positions.device, non_blocking=True)
        return _WindowPlan(write_slots, write_offsets, decode_slots, decode_mask, prefills)

    def _plan_decode(self, seqs: list[SeqLayout], pos: torch.Tensor,
                     window: int) -> tuple[torch.Tensor, torch.Tensor]:
        spans = [_block_span(s, window, self.tpb) for s in seqs]
        width = max(hi - lo for lo, hi in spans)  # blocks per sequence, padded
        table, first = [], []
        for seq, (lo, hi) in zip(seqs, spans, strict=True):
            table += _checked_slots(seq, window, lo, hi) + [0] * (width - (hi - lo))
            first.append(lo * self.tpb)
        slots = torch.tensor(table, dtype=torch.int64).to(pos.device, non_blocking=True)
        key_start = torch.tensor(first, dtype=torch.int64).to(pos.device, non_blocking=True)
        key_pos = key_start[:, None] + torch.arange(width * self.tpb, device=pos.device)  # [S, L]
        mask = _visible(pos[:, None], key_pos, window)
        return slots, mask[:, None, None, :]

    def _plan_prefill(self, seq: SeqLayout, pos: torch.Tensor, rows: slice, window: int) -> _Prefill:
        lo, hi = _block_span(seq, window, self.tpb)
        slots = torch.tensor(_checked_slots(seq, window, lo, hi), dtype=torch.int64)
        key_pos = torch.arange(lo * self.tpb, hi * self.tpb, device=pos.device)
        mask = _visible(pos[:, None], key_pos[None, :], window)
        return _Prefill(rows, slots.to(pos.device, non_blocking=True), mask)

    # ---- per layer
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: dict[int, _WindowPlan]) -> torch.Tensor:
        window, k_cache, v_cache = self.layers[layer]  # caches [slots, tpb, kv_heads, head_dim]
        plan = meta[window]
        k_cache[plan.write_slots, plan.write_offsets] = k
        v_cache[plan.write_slots, plan.write_offsets] = v
        outs = []
        if plan.decode_slots is not None:
            outs.append(self._decode(q[: plan.decode_mask.shape[0]], k_cache, v_cache, plan))
        for p in plan.prefills:
            outs.append(self._prefill(q[p.rows], k_cache, v_cache, p))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                plan: _WindowPlan) -> torch.Tensor:
        """One query per sequence. GQA without copies: the q heads sharing a kv head become that
        head's query rows, so SDPA runs [S, kv_heads, group, D] x [S, kv_heads, L, D]."""
        s, kv_heads, d = q.shape[0], k_cache.shape[2], q.shape[2]
        keys = _gather(k_cache, plan.decode_slots, s)  # [S, kv_heads, L, D]
        values = _gather(v_cache, plan.decode_slots, s)
        qg = q.view(s, kv_heads, self.num_heads // kv_heads, d)
        out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=plan.decode_mask, scale=self.scale)
        return out.reshape(s, self.num_heads, d)

    def _prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 p: _Prefill) -> torch.Tensor:
        keys = _gather(k_cache, p.slots, 1)[0]  # [kv_heads, L, D]
        values = _gather(v_cache, p.slots, 1)[0]
        out = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=p.mask,
                                             scale=self.scale, enable_gqa=True)  # [heads, Q, D]
        return out.transpose(0, 1)


def _gather(cache: torch.Tensor, slots: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """cache [slots, tpb, kv_heads, D], slots [num_seqs * blocks] -> [num_seqs, kv_heads, blocks * tpb, D]."""
    blocks = cache.index_select(0, slots)  # [num_seqs * blocks, tpb, kv_heads, D]
    return blocks.view(num_seqs, -1, cache.shape[2], cache.shape[3]).transpose(1, 2)


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """Causal + sliding window: p - window < k <= p (transformers' rule)."""
    return (k_pos <= q_pos) & (k_pos > q_pos - window)


def _block_span(seq: SeqLayout, window: int, tpb: int) -> tuple[int, int]:
    """[lo, hi) block indices holding every key some query of the chunk may see."""
    first_key = max(0, seq.num_past - window + 1)
    return first_key // tpb, (seq.num_past + seq.num_new - 1) // tpb + 1


def _checked_slots(seq: SeqLayout, window: int, lo: int, hi: int) -> list[int]:
    slots = seq.slot_tables[window][lo:hi]
    if len(slots) != hi - lo or -1 in slots:
        raise ValueError(f"slot table of window {window} lacks blocks {lo}..{hi - 1} "
                         f"(num_past={seq.num_past}, num_new={seq.num_new}): {slots}")
    return slots


def _write_indices(seqs: list[SeqLayout], window: int, tpb: int) -> tuple[list[int], list[int]]:
    """(slot, offset) of every new token, in flattened order."""
    slots: list[int] = []
    offsets: list[int] = []
    for seq in seqs:
        table = seq.slot_tables[window]
        start, end = seq.num_past, seq.num_past + seq.num_new
        while start < end:  # one run of offsets per block
            stop = min(end, (start // tpb + 1) * tpb)
            slots += [table[start // tpb]] * (stop - start)
            offsets += range(start % tpb, (stop - 1) % tpb + 1)
            start = stop
    return slots, offsets
