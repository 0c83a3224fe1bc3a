"""A MoE gate's top-k after its linear, one Triton program per token: scores (softmax or sigmoid), the
top-k experts, their weights normalised, scaled and rounded as the spec says, and each expert's load
counted, in one kernel where the torch path (moe/router.py `route`, then the load's scatter) launches
about ten small ones per layer: at one token a decode step's MoE layers were mostly such launches.

Experts are ranked by their logits (the scores are monotonic in them, so the same experts as ranking
the scores, without the ties that rounding the scores can make), highest first, the lower index first
among equal logits; a token's weights come out in that order, as `torch.topk`'s sorted output. Only the
plain top-k (`topk_method` greedy, no correction bias) runs here; group-limited routing keeps torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from server.models.moe.config import MoESpec


@triton.jit
def _route(LOGITS, WEIGHTS, IDS, LOAD, ROUND_LIKE, num_experts, stride_l, scale, eps,
           TOP_K: tl.constexpr, EP: tl.constexpr, SIGMOID: tl.constexpr, NORM: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.arange(0, EP)
    live = offs < num_experts
    logit = tl.load(LOGITS + t * stride_l + offs, mask=live, other=float("-inf")).to(tl.float32)
    if SIGMOID:
        score = tl.sigmoid(logit)
    else:
        e = tl.exp(logit - tl.max(logit, 0))
        score = e / tl.sum(e, 0)
    choice = tl.where(logit == logit, logit, float("inf"))  # NaN ranks highest, as in torch.topk
    rank = tl.full([EP], TOP_K, tl.int32)  # TOP_K: not chosen
    free = live
    for j in tl.static_range(TOP_K):  # only free experts compete: TOP_K distinct ids below E, whatever the logits
        candidate = tl.where(free, choice, float("-inf"))
        best = tl.max(candidate, 0)
        pick = tl.min(tl.where(free & (candidate == best), offs, EP), 0)
        rank = tl.where(offs == pick, j, rank)
        free = free & (offs != pick)
    chosen = rank < TOP_K
    w = tl.where(chosen, score, 0.0)
    if NORM:
        w = w / (tl.sum(w, 0) + eps)
    w = w * scale
    if ROUND_LIKE.dtype.element_ty == tl.bfloat16:  # rounded to the model dtype, as the torch path hands them over
        bits = w.to(tl.int32, bitcast=True)  # to nearest, ties to even (the CPU interpreter's cast truncates)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        w = bits.to(tl.float32, bitcast=True)
    elif ROUND_LIKE.dtype.element_ty != tl.float32:
        w = w.to(ROUND_LIKE.dtype.element_ty).to(tl.float32)
    tl.store(WEIGHTS + t * TOP_K + rank, w, mask=chosen)
    tl.store(IDS + t * TOP_K + rank, offs.to(tl.int64), mask=chosen)
    tl.atomic_add(LOAD + offs, chosen.to(tl.int64), mask=chosen, sem="relaxed")


def fits(spec: MoESpec) -> bool:
    """Whether this spec's routing is the plain top-k this kernel computes."""
    return spec.topk_method == "greedy" and not spec.score_correction_bias


def fused_route(spec: MoESpec, logits: torch.Tensor, x: torch.Tensor,
                load: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """moe/router.py `route` after the gate's linear (`logits` [T, E], any float dtype), the block's
    rounding to x's dtype and its load count, for a spec that `fits`."""
    eps = 1e-20 if spec.scoring == "sigmoid" else 0.0
    return fused_topk(logits, spec.top_k, spec.scoring == "sigmoid", spec.norm_topk_prob, spec.routed_scaling_factor,
                      eps, x if spec.round_weights else None, load)


def fused_topk(logits: torch.Tensor, top_k: int, sigmoid: bool, norm: bool, scale: float, eps: float,
               round_like: torch.Tensor | None, load: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, top_k] float32, ids [T, top_k] int64); adds each expert's chosen
    count to `load` [E] int64. `norm`: weights / (their sum + eps); then times `scale`; `round_like`: rounded
    to that tensor's dtype (kept float32)."""
    t, num_experts = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    weights = torch.empty((t, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((t, top_k), dtype=torch.int64, device=logits.device)
    if t:
        like = weights if round_like is None else round_like  # (its dtype only, float32: no rounding; never read)
        _route[(t,)](logits, weights, ids, load, like, num_experts, logits.stride(0), scale, eps, TOP_K=top_k,
                     EP=triton.next_power_of_2(num_experts), SIGMOID=sigmoid, NORM=norm,
                     num_warps=1 if num_experts <= 128 else 4)
    return weights, ids
