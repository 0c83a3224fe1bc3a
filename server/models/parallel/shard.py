"""A tensor-parallel rank's weights, read slice by slice from safetensors, and its local model shape.

By HF name (Megatron style): q/k/v and gate/up are column-parallel (output rows split: the rank's q
heads, kv heads, intermediate columns), o and down row-parallel (input columns split; the model
all-reduces their outputs), a row-parallel bias kept by rank 0 alone (zeros elsewhere). Embedding
and lm_head are split by vocabulary rows, zero-padded to `plan.vocab_per_rank`; norms are whole.
A MoE layer's experts split like dense MLPs by their own widths (transformers 5's stacked
`experts.gate_up_proj` takes the rank's rows of both halves), as does the shared expert; the router,
Qwen2-MoE's `shared_expert_gate` and DeepSeek-V3's `e_score_correction_bias` are whole. With expert
parallelism a rank reads only its own experts, whole. FP8 scales follow their weight's output rows:
a per-channel scale of a column-parallel weight is split like its rows, any other scale is whole.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch

from server.models.fp8.load import SCALES, load_checkpoint
from server.models.model_spec import ModelSpec
from server.models.parallel.plan import ShardPlan

_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


_EXPERT = re.compile(r"\.experts\.(\d+)\.")  # a routed expert's own tensor (not the shared expert's)
_COLUMN_FFN = ("gate_proj", "up_proj", "w1", "w3")  # output rows split
_ROW_FFN = ("down_proj", "w2")  # input columns split


def plan_for(spec: ModelSpec, rank: int, size: int, *, expert_parallel: bool = False) -> ShardPlan:
    """`expert_parallel`: a MoE model's routed experts spread whole over the ranks (num_experts / size
    each), not each split; everything else is split as without it."""
    moe = spec.moe
    others = () if moe is None else (("moe_intermediate_size", moe.intermediate_size),
                                     ("shared expert intermediate size", moe.shared_intermediate_size))
    return ShardPlan(rank=rank, size=size, num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads,
                     intermediate_size=spec.intermediate_size, vocab_size=spec.vocab_size, other_ffn_sizes=others,
                     num_experts=moe.num_experts if moe is not None else 0,
                     expert_parallel=expert_parallel and moe is not None)


def local_spec(spec: ModelSpec, plan: ShardPlan) -> ModelSpec:
    """The shape the rank's model computes with: its heads, kv heads and FFN columns (every expert's)."""
    kv0, kv1 = plan.kv_heads
    return dataclasses.replace(spec, num_heads=spec.num_heads // plan.size, num_kv_heads=kv1 - kv0,
                               intermediate_size=spec.intermediate_size // plan.size,
                               moe=None if spec.moe is None else spec.moe.sharded(
                                   plan.size, plan.rank, expert_parallel=plan.expert_parallel))


def load_shard(spec: ModelSpec, plan: ShardPlan, dtype: torch.dtype, device: torch.device,
               quantization: str | None = None) -> dict[str, Any]:
    """The rank's slice of every tensor of the model, as `dtype` on `device` (linears as FP8 where the
    checkpoint is FP8 or `quantization` is "fp8": each rank quantizes its own slices)."""
    quant = spec.checkpoint_quant
    if quant is not None and quant.block is not None and plan.size > 1:
        raise ValueError(f"model {spec.model_dir}: config.json: quantization_config.weight_block_size: "
                         f"{list(quant.block)}: block-scaled FP8 checkpoints are served on one GPU only (no "
                         "tensor or expert parallelism)")
    return load_checkpoint(spec, dtype=dtype, device=device, quantization=quantization,
                           slicer=lambda name, handle: shard_slice(name, handle, spec, plan))


def shard_slice(name: str, handle: Any, spec: ModelSpec, plan: ShardPlan) -> torch.Tensor | None:
    """The part of tensor `name` (`handle`: its safetensors slice) `plan.rank` holds; None: another rank's expert."""
    if name in _VOCAB:
        return _vocab_rows(handle, plan)
    if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
        return _stacked_experts(name, handle, plan)
    expert = _EXPERT.search(name)
    if expert is not None and plan.expert_parallel:  # a whole expert, on its rank only
        e0, e1 = plan.experts
        return handle[:] if e0 <= int(expert.group(1)) < e1 else None
    kind = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
    if spec.mla is not None and kind in _MLA_HEAD_ROWS and not name.endswith(SCALES):
        return _mla_slice(handle, kind, spec, plan)
    shape = handle.get_shape()
    if name.endswith(SCALES):  # per channel of a column-parallel weight: its rows; else whole
        rows = _column_rows(kind, shape, spec, plan) if shape and shape[0] != 1 else None
        return handle[...] if rows is None else handle[rows[0]:rows[1]]
    rows = _column_rows(kind, shape, spec, plan)
    if rows is not None:
        return handle[rows[0]:rows[1]]
    if kind in ("o_proj", *_ROW_FFN):
        if name.endswith(".bias"):  # added once, after the all-reduce sums the ranks' parts
            return handle[:] if plan.rank == 0 else torch.zeros(shape)
        h0, h1 = plan.heads
        f0, f1 = (h0 * spec.head_dim, h1 * spec.head_dim) if kind == "o_proj" else plan.share(shape[1])
        return handle[:, f0:f1]
    return handle[:]


def _column_rows(kind: str, shape: list[int], spec: ModelSpec, plan: ShardPlan) -> tuple[int, int] | None:
    """[start, end) of the output rows the rank holds of a column-parallel projection (q/k/v: its
    heads', gate/up: its even share); None for any other `kind`."""
    d = spec.head_dim
    if kind == "q_proj":
        return plan.heads[0] * d, plan.heads[1] * d
    if kind in ("k_proj", "v_proj"):
        return plan.kv_heads[0] * d, plan.kv_heads[1] * d
    return plan.share(shape[0]) if kind in _COLUMN_FFN else None


# multi-head latent attention (DeepSeek): per head, the rows of q_proj / q_b_proj (qk_head_dim each)
# and of kv_b_proj (qk_nope_head_dim + v_head_dim), and o_proj's columns (v_head_dim); q_a_proj,
# kv_a_proj_with_mqa and their norms, which make the latent every rank caches, are whole
_MLA_HEAD_ROWS = ("q_proj", "q_b_proj", "kv_b_proj", "o_proj")


def _mla_slice(handle: Any, kind: str, spec: ModelSpec, plan: ShardPlan) -> torch.Tensor:
    mla, (h0, h1) = spec.mla, plan.heads
    if kind == "o_proj":
        return handle[:, h0 * mla.v_head_dim:h1 * mla.v_head_dim]
    per = mla.qk_nope_head_dim + mla.v_head_dim if kind == "kv_b_proj" else mla.qk_head_dim
    return handle[h0 * per:h1 * per]


def _stacked_experts(name: str, handle: Any, plan: ShardPlan) -> torch.Tensor:
    """transformers 5's stacked experts: gate_up [E, 2I, hidden] -> the rank's rows of the gate half
    and of the up half; down [E, hidden, I] -> its columns (expert parallelism: the rank's experts whole)."""
    if plan.expert_parallel:
        e0, e1 = plan.experts
        return handle[e0:e1]
    if name.endswith("down_proj"):
        f0, f1 = plan.share(handle.get_shape()[2])
        return handle[:, :, f0:f1]
    half = handle.get_shape()[1] // 2
    f0, f1 = plan.share(half)
    return torch.cat([handle[:, f0:f1], handle[:, half + f0:half + f1]], dim=1)


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
