"""Paged attention over a flattened (varlen) batch: the backend interface and a portable torch backend.

A step (`StepLayout`) is decode sequences (one query each) first, then prefill chunks, T rows in
all. A backend builds per-window metadata once per step (`plan`); each layer's `forward` writes the
new K/V into its cache and attends through the block tables with a causal + sliding-window mask (a
query at position p sees keys k with p - window < k <= p). `forward` never syncs the host: every
index and mask is built in `plan` and uploaded in one copy. Pools are zero-initialised, so padded
or masked slots never inject NaN.

An FP8 cache stores e4m3(K / k_scale) and e4m3(V / v_scale) per layer (`quantize_fp8`, the rounding
the Triton kernels reproduce bit for bit); reads widen the gathered blocks to the model's dtype and
fold k_scale into the softmax scale, v_scale into the output.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from kvcache.layout import FP8, inverse_scale, quantize_fp8
from server.models.rope import apply_rotary


class PagedKV(Protocol):
    """What attention needs from the KV cache manager (`kvcache.KVCacheManager` provides it)."""

    tokens_per_block: int
    window_sizes: tuple[int, ...]

    def layer_cache(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V views [slots, tokens_per_block, kv_heads, head_dim]; V follows K in each slot."""

    def layer_latent(self, layer_idx: int) -> torch.Tensor:
        """A latent cache's layer (MLA): [slots, tokens_per_block, width] (a view)."""

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


class AttentionBackend(ABC):
    """Attention for one model: `plan` once per step, then `forward` per layer with that plan."""

    @abstractmethod
    def plan(self, layout: StepLayout, positions: torch.Tensor) -> object:
        """Metadata for the step; `positions` [T] int64 on the device, in flattened order."""

    @abstractmethod
    def forward(self, layer: int, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: object) -> torch.Tensor:
        """qkv [T, heads + 2 * kv_heads, head_dim] before RoPE, cos / signed sin [T, rotary_dim]
        (`Rotary.cos_sin`) -> [T, heads, head_dim]; rotates the first rotary_dim dims of q and k and
        writes K/V into the cache."""


@dataclass
class Attend:
    """One attention call: `rows` of the flattened batch against the keys of `units`."""

    rows: slice
    units: torch.Tensor  # [seqs * 2 * blocks] int64: per sequence its K units, then its V units (padding: slot 0)
    mask: torch.Tensor  # [seqs, 1, 1, keys] (decode) or [rows, keys] (prefill): 0 = attend, -inf = not


@dataclass
class WindowPlan:
    """Shared by every layer of one window group for one step."""

    write_rows: torch.Tensor  # [T, 2] int64 token row (units view) of each new token's K and V
    decode: Attend | None  # all decode sequences at once, one query each
    prefills: list[Attend]  # one per prefill chunk

    def attend(self, q: torch.Tensor, decode: Callable[[torch.Tensor, Attend], torch.Tensor],
               prefill: Callable[[torch.Tensor, Attend], torch.Tensor]) -> torch.Tensor:
        """`decode` of the decode rows of q, then `prefill` of each chunk's, concatenated in row order."""
        outs = [] if self.decode is None else [decode(q[self.decode.rows], self.decode)]
        outs += [prefill(q[p.rows], p) for p in self.prefills]
        return outs[0] if len(outs) == 1 else torch.cat(outs)


class AdditiveMask:
    """hi, lo [R] int64 -> [R, width] in `dtype`: key j visible (0) iff lo < j <= hi, else -inf."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self._zero = torch.zeros((), dtype=dtype, device=device)
        self._neg_inf = torch.full((), float("-inf"), dtype=dtype, device=device)

    def __call__(self, hi: torch.Tensor, lo: torch.Tensor | None, width: int) -> torch.Tensor:
        j = torch.arange(width, device=hi.device)
        visible = j <= hi[:, None]
        if lo is not None:
            visible &= j > lo[:, None]
        return torch.where(visible, self._zero, self._neg_inf)


def plan_windows(layout: StepLayout, positions: torch.Tensor, tpb: int, units_per_slot: dict[int, int],
                 mask_fn: _MaskFn, planes: int = 2) -> dict[int, WindowPlan]:
    """Every window's plan of a step (`WindowPlan`), its indices uploaded in one copy."""
    host = HostInts()
    specs = {w: _HostWindow(layout, w, tpb, ups, host, planes) for w, ups in units_per_slot.items()}
    ints = host.upload(positions.device)
    return {w: spec.on_device(ints, mask_fn) for w, spec in specs.items()}


class SdpaPaged:
    """What the torch backends share: every layer's units views (the manager allocates its pools once,
    so they stay valid), the step's `plan_windows` with `planes` units per block, the mask in `dtype`,
    and SDPA over the keys and values a backend gathers (`_keys_values`), the softmax scale times the
    layer's k scale (an FP8 cache's; 1.0 otherwise)."""

    def __init__(self, kv: PagedKV, layers: list[LayerUnits], num_heads: int, num_kv_heads: int, scale: float,
                 dtype: torch.dtype, planes: int) -> None:
        self.kv, self.tpb, self.layers, self.planes = kv, kv.tokens_per_block, layers, planes
        self.num_heads, self.num_kv_heads, self.scale, self.dtype = num_heads, num_kv_heads, scale, dtype
        self.units_per_slot = {u.window: u.units_per_slot for u in layers}
        self.quantized = layers[0].blocks.dtype == FP8
        self._mask = AdditiveMask(dtype, layers[0].blocks.device)

    def plan(self, layout: StepLayout, positions: torch.Tensor) -> dict[int, WindowPlan]:
        return plan_windows(layout, positions, self.tpb, self.units_per_slot, self._mask, self.planes)

    def _keys_values(self, blocks: torch.Tensor, units: torch.Tensor, num_seqs: int,
                     dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of `units`, each [num_seqs, kv_heads, keys, width] in `dtype`."""
        raise NotImplementedError

    def _attend(self, q: torch.Tensor, plan: WindowPlan, blocks: torch.Tensor, k_scale: float) -> torch.Tensor:
        return plan.attend(q, lambda q, a: self._decode(q, blocks, a, k_scale),
                           lambda q, a: self._prefill(q, blocks, a, k_scale))

    def _decode(self, q: torch.Tensor, blocks: torch.Tensor, a: Attend, k_scale: float) -> torch.Tensor:
        """One query per sequence. GQA without copies: the q heads sharing a kv head become that
        head's query rows, so SDPA runs [S, kv_heads, group, D] x [S, kv_heads, L, D]."""
        s, kv_heads = q.shape[0], self.num_kv_heads
        keys, values = self._keys_values(blocks, a.units, s, q.dtype)
        qg = q.view(s, kv_heads, self.num_heads // kv_heads, q.shape[2])
        out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=a.mask, scale=self.scale * k_scale)
        return out.reshape(s, self.num_heads, -1)  # CUDA may return another layout

    def _prefill(self, q: torch.Tensor, blocks: torch.Tensor, a: Attend, k_scale: float) -> torch.Tensor:
        """4-D inputs on purpose: with 3-D ones torch takes its unfused math path (about 4x slower
        for a 256-token prompt on the CPU)."""
        keys, values = self._keys_values(blocks, a.units, 1, q.dtype)  # each [1, kv_heads, L, width]
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, values, attn_mask=a.mask,
                                             scale=self.scale * k_scale, enable_gqa=True)
        return out[0].transpose(0, 1)  # [1, heads, Q, D] -> [Q, heads, D]


class TorchPagedAttention(SdpaPaged, AttentionBackend):
    """Portable backend (CPU and CUDA): gathers K and V blocks with one index_select, attends with SDPA."""

    def __init__(self, kv: PagedKV, num_layers: int, num_heads: int, head_dim: int,
                 dtype: torch.dtype | None = None) -> None:
        """`dtype`: the model's; default the cache's (which an FP8 cache is not)."""
        layers = [layer_units(kv.layer_window(i), *kv.layer_cache(i)) for i in range(num_layers)]
        cache = layers[0].blocks
        if cache.dtype == FP8 and dtype is None:
            raise ValueError("an FP8 KV cache needs the model's dtype (TorchPagedAttention dtype=)")
        super().__init__(kv, layers, num_heads, cache.shape[2], head_dim**-0.5, dtype or cache.dtype, planes=2)
        self.scales = [kv.layout.format.layer_scales(i) for i in range(num_layers)]  # (k, v) per layer
        # per layer [1, 2, 1, 1]: what K and V are multiplied by before they are rounded to FP8
        self._inverse = [torch.tensor([inverse_scale(k), inverse_scale(v)], device=cache.device).view(1, 2, 1, 1)
                         for k, v in self.scales] if self.quantized else []

    def forward(self, layer: int, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: dict[int, WindowPlan]) -> torch.Tensor:
        heads, kv_heads = self.num_heads, self.num_kv_heads
        q = apply_rotary(qkv[:, :heads], cos, sin)
        k = apply_rotary(qkv[:, heads:heads + kv_heads], cos, sin)
        kv = torch.stack((k, qkv[:, heads + kv_heads:]), 1)  # [T, 2, kv_heads, head_dim]: K then V
        cache = self.layers[layer]
        plan = meta[cache.window]
        if self.quantized:  # written as bytes: torch has no indexed write of float8 everywhere
            kv = quantize_fp8(kv, self._inverse[layer]).view(torch.uint8)
        as_stored(cache.tokens).index_put_((plan.write_rows,), kv)  # [T, 2] rows <- [T, 2, kv_heads, D]
        out = self._attend(q, plan, cache.blocks, self.scales[layer][0])
        return out * self.scales[layer][1] if self.quantized else out  # dequantized values: times v_scale

    def _keys_values(self, blocks: torch.Tensor, units: torch.Tensor, num_seqs: int,
                     dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """blocks [units, tpb, kv_heads, D], units [num_seqs * 2 * nb]: per sequence its K units, then
        its V units -> K, V each [num_seqs, kv_heads, nb * tpb, D] (views of one gathered tensor)."""
        kv = gather_units(blocks, units, dtype).view(num_seqs, 2, -1, blocks.shape[2], blocks.shape[3])
        return kv[:, 0].transpose(1, 2), kv[:, 1].transpose(1, 2)


def as_stored(t: torch.Tensor) -> torch.Tensor:
    """A view of pool memory to index: an FP8 pool's as bytes (float8 has no indexed CPU copies)."""
    return t.view(torch.uint8) if t.dtype == FP8 else t


def gather_units(blocks: torch.Tensor, units: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks[units] in `dtype`: an FP8 cache's widened exactly (e4m3 values are bf16/fp16/float32 values)."""
    out = as_stored(blocks).index_select(0, units)
    return out.view(FP8).to(dtype) if blocks.dtype == FP8 else out


@dataclass
class _HostAttend:
    """Host half of an `Attend`: slices of the step's `HostInts`."""

    rows: slice
    units: slice
    hi: slice  # per query row: index of its own key (the last visible one)
    lo: slice | None  # per query row: hi - window (keys at or below are out of the window); None: none are
    width: int  # keys per sequence (blocks * tpb)


_MaskFn = Callable[[torch.Tensor, torch.Tensor | None, int], torch.Tensor]


class _HostWindow:
    """Host half of one window's plan: index data appended to the step's `HostInts`, as slices."""

    def __init__(self, layout: StepLayout, window: int, tpb: int, units_per_slot: int,
                 host: HostInts, planes: int = 2) -> None:
        """`planes`: units per block of one layer, 2 (K, V) or 1 (a latent cache's)."""
        self.window, self.tpb, self.ups, self.host, self.planes = window, tpb, units_per_slot, host, planes
        nd = layout.num_decode
        self.decode = self._attend(layout.seqs[:nd], slice(0, nd)) if nd else None
        self.prefills, row = [], nd
        for seq in layout.seqs[nd:]:
            self.prefills.append(self._attend([seq], slice(row, row + seq.num_new)))
            row += seq.num_new
        # after the span checks above: every new token's block is present
        self.write = host.add(_write_rows(layout.seqs, window, tpb, units_per_slot, planes))

    def _attend(self, seqs: list[SeqLayout], rows: slice) -> _HostAttend:
        """Host data of one attention call over `seqs` (several only for decode, one query each)."""
        window, tpb = self.window, self.tpb
        spans = [_block_span(s, window, tpb) for s in seqs]
        nb = max(hi - lo for lo, hi in spans)  # blocks per sequence, padded
        units, his = [], []
        for seq, (lo, hi) in zip(seqs, spans, strict=True):
            k_units = [s * self.ups for s in _checked_slots(seq, window, lo, hi)] + [0] * (nb - (hi - lo))
            units += k_units + ([u + 1 for u in k_units] if self.planes == 2 else [])  # K units, then V units
            start = seq.num_past - lo * tpb  # key index of the chunk's first query
            his += range(start, start + seq.num_new)
        sliding = max(his) >= window  # else no query's window starts after key 0 of its span
        return _HostAttend(rows, self.host.add(units), self.host.add(his),
                           self.host.add([h - window for h in his]) if sliding else None, nb * tpb)

    def on_device(self, ints: torch.Tensor, mask_fn: _MaskFn) -> WindowPlan:
        """`ints` is the uploaded `HostInts`; every index becomes a view of it."""
        def attend(a: _HostAttend, decode: bool) -> Attend:
            mask = mask_fn(ints[a.hi], None if a.lo is None else ints[a.lo], a.width)
            return Attend(a.rows, ints[a.units], mask[:, None, None, :] if decode else mask)

        return WindowPlan(ints[self.write].view(-1, self.planes),
                           attend(self.decode, True) if self.decode else None,
                           [attend(p, False) for p in self.prefills])


@dataclass(frozen=True)
class LayerUnits:
    """One layer's cache as units of one block of K or V (unit u = slot * units_per_slot + j, j = 0
    for K, 1 for V), or of a latent cache's rows (j = 0). The views span the whole pool, other
    layers' units between ours; only indices built with `units_per_slot` are used."""

    window: int
    units_per_slot: int  # pool slot stride / unit size (planes x layers of the window group)
    blocks: torch.Tensor  # [num_units, tpb, kv_heads, head_dim] or [num_units, tpb, width] (a view of the pool)
    tokens: torch.Tensor  # [num_units * tpb, ...], same memory; row = unit * tpb + offset


def layer_units(window: int, k: torch.Tensor, v: torch.Tensor) -> LayerUnits:
    """Units views from a layer's K and V views (`PagedKV.layer_cache`); V must follow K in each slot."""
    slots, tpb, heads, dim = k.shape
    unit = tpb * heads * dim
    fits = (v.shape == k.shape and v.stride() == k.stride() and k.stride()[1:] == (heads * dim, dim, 1)
            and v.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()
            and v.storage_offset() - k.storage_offset() == unit and k.stride(0) % unit == 0)
    if not fits:
        raise ValueError(f"KV cache layout not supported: K {tuple(k.shape)} strides {k.stride()}, V must "
                         "follow K directly in each slot of one slot-major pool")
    return units_view(window, k, planes=2)


def units_view(window: int, view: torch.Tensor, planes: int) -> LayerUnits:
    """The units of a checked layer view [slots, tpb, *row] (rows contiguous, slot stride a multiple
    of the unit), up to the last slot's `planes` units."""
    slots, tpb, *row = view.shape
    per_slot = view.stride(0) // view.stride(1) // tpb
    num_units = (slots - 1) * per_slot + planes
    tokens = torch.as_strided(view, (num_units * tpb, *row), view.stride()[1:], view.storage_offset())
    return LayerUnits(window, per_slot, tokens.view(num_units, tpb, *row), tokens)


class HostInts:
    """A step's index data collected on the host, so it reaches the device in one copy. With `align`,
    every part starts on a multiple of `align` values: the Triton backend's int32 parts start on
    16-byte boundaries, else Triton would compile a kernel variant per alignment pattern of the
    step's sizes (a fresh server under varied load would spend its first minute compiling)."""

    def __init__(self, dtype: torch.dtype = torch.int64, align: int = 1) -> None:
        self.dtype, self.align = dtype, align
        self.values: list[int] = []

    def add(self, values: list[int]) -> slice:
        start = len(self.values)
        self.values += values
        self.values += [0] * (-len(self.values) % self.align)
        return slice(start, start + len(values))

    def upload(self, device: torch.device) -> torch.Tensor:
        return torch.tensor(self.values, dtype=self.dtype).to(device, non_blocking=True)


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


def _write_rows(seqs: list[SeqLayout], window: int, tpb: int, units_per_slot: int, planes: int = 2) -> list[int]:
    """Token rows (units view) of each new token's K and V, in order: [k0, v0, k1, ...] (one plane: [k0, k1, ...])."""
    rows: list[int] = []
    for seq in seqs:
        table = seq.slot_tables[window]
        for pos in range(seq.num_past, seq.num_past + seq.num_new):
            k_row = table[pos // tpb] * units_per_slot * tpb + pos % tpb
            rows += (k_row, k_row + tpb) if planes == 2 else (k_row,)
    return rows
