"""A tensor-parallel rank's weights, read slice by slice from safetensors, and its local model shape.

By HF name (Megatron style): q/k/v and gate/up are column-parallel (their output rows are split:
the rank's q heads, kv heads, intermediate columns), o and down are row-parallel (their input
columns are split; the model all-reduces their outputs). A row-parallel bias is added once: rank 0
keeps it and the other ranks hold zeros. The embedding and lm_head are split by vocabulary rows,
padded with zero rows to `plan.vocab_per_rank`. Norms (and Qwen3's per-head q/k norms) are whole.
FP8 scales (server/models/fp8/) follow their weight's output rows: a per-channel scale of a
column-parallel weight is split like its rows, one of a row-parallel weight (o, down: every rank
has all output rows) and every per-tensor or input scale is whole.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from server.models.fp8.load import SCALES, load_checkpoint
from server.models.model_spec import ModelSpec
from server.models.parallel.plan import ShardPlan
from server.models.weights import safetensors_files

_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


def plan_for(spec: ModelSpec, rank: int, size: int) -> ShardPlan:
    return ShardPlan(rank=rank, size=size, num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads,
                     intermediate_size=spec.intermediate_size, vocab_size=spec.vocab_size)


def local_spec(spec: ModelSpec, plan: ShardPlan) -> ModelSpec:
    """The shape the rank's model computes with: its heads, kv heads and FFN columns."""
    kv0, kv1 = plan.kv_heads
    return dataclasses.replace(spec, num_heads=spec.num_heads // plan.size, num_kv_heads=kv1 - kv0,
                               intermediate_size=spec.intermediate_size // plan.size)


def load_shard(spec: ModelSpec, plan: ShardPlan, dtype: torch.dtype, device: torch.device,
               quantization: str | None = None) -> dict[str, Any]:
    """The rank's slice of every tensor of the model, as `dtype` on `device` (linears as FP8 where the
    checkpoint is FP8 or `quantization` is "fp8": each rank quantizes its own slices)."""
    return load_checkpoint(spec, safetensors_files(spec.model_dir), dtype=dtype, device=device,
                           quantization=quantization, slicer=lambda name, handle: shard_slice(name, handle, spec, plan))


def shard_slice(name: str, handle: Any, spec: ModelSpec, plan: ShardPlan) -> torch.Tensor:
    """The part of tensor `name` that `plan.rank` holds (`handle` is a safetensors slice)."""
    d = spec.head_dim
    (h0, h1), (k0, k1), (f0, f1) = plan.heads, plan.kv_heads, plan.ffn
    if name in _VOCAB:
        return _vocab_rows(handle, plan)
    kind = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
    if name.endswith(SCALES):
        return _scale_slice(handle, kind, spec, plan)
    is_bias = name.endswith(".bias")
    if kind == "q_proj":
        return handle[h0 * d:h1 * d]
    if kind in ("k_proj", "v_proj"):
        return handle[k0 * d:k1 * d]
    if kind in ("gate_proj", "up_proj"):
        return handle[f0:f1]
    if kind in ("o_proj", "down_proj"):
        if is_bias:  # added once, after the all-reduce sums the ranks' parts
            return handle[:] if plan.rank == 0 else torch.zeros(handle.get_shape())
        return handle[:, h0 * d:h1 * d] if kind == "o_proj" else handle[:, f0:f1]
    return handle[:]


def _scale_slice(handle: Any, kind: str, spec: ModelSpec, plan: ShardPlan) -> torch.Tensor:
    """A per-channel scale of a column-parallel weight: the rank's rows; any other scale: whole."""
    shape = handle.get_shape()
    if not shape or shape[0] == 1 or kind not in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
        return handle[...]
    d = spec.head_dim
    (h0, h1), (k0, k1), (f0, f1) = plan.heads, plan.kv_heads, plan.ffn
    rows = {"q_proj": (h0 * d, h1 * d), "k_proj": (k0 * d, k1 * d), "v_proj": (k0 * d, k1 * d)}.get(kind, (f0, f1))
    return handle[rows[0]:rows[1]]


def _vocab_rows(handle: Any, plan: ShardPlan) -> torch.Tensor:
    """Rows [start, end) of the vocabulary, zero rows past its end (padding)."""
    start, end = plan.vocab
    rows = handle[start:min(end, plan.vocab_size)] if start < plan.vocab_size else None
    hidden = handle.get_shape()[1]
    out = torch.zeros((end - start, hidden), dtype=rows.dtype if rows is not None else torch.float32,
                      device=rows.device if rows is not None else "cpu")
    if rows is not None:
        out[:rows.shape[0]] = rows
    return out
