"""The gate of a MoE block: which experts each token goes to, and with what weight.

`route` computes what transformers' routers compute, op for op, so that float32 picks the same
experts; on the device with static shapes, so it runs inside CUDA graphs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from server.models.moe.config import MoESpec


def route(spec: MoESpec, x: torch.Tensor, gate: torch.Tensor, correction: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, hidden], gate [num_experts, hidden] (the router's weight), `correction` [num_experts]
    (DeepSeek-V3's e_score_correction_bias) -> (weights [T, top_k] float32, expert ids [T, top_k] int64)."""
    logits = gate_logits(spec, x, gate).float()
    if spec.scoring == "sigmoid":
        scores = logits.sigmoid()
    else:
        scores = logits.softmax(dim=-1)
    if spec.topk_method == "noaux_tc":
        weights, ids = _noaux_tc(spec, scores, correction)
    elif spec.topk_method == "group_limited_greedy":
        weights, ids = _group_limited(spec, scores)
    else:
        weights, ids = torch.topk(scores, spec.top_k, dim=-1)
    if spec.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if spec.scoring == "sigmoid" else 0.0))
    if spec.routed_scaling_factor != 1.0:
        weights = weights * spec.routed_scaling_factor
    return weights, ids


def gate_logits(spec: MoESpec, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """[T, num_experts]: the gate's linear, in float32 (DeepSeek) or in the model dtype."""
    return F.linear(x.float(), gate.float()) if spec.router_float32 else F.linear(x, gate)


def _group_mask(spec: MoESpec, scores: torch.Tensor, best: int) -> torch.Tensor:
    """scores [T, num_experts] -> [T, num_experts] bool: the experts of each token's topk_group groups,
    a group ranked by the sum of its `best` highest scores."""
    per_group = spec.num_experts // spec.n_group
    group_scores = scores.view(-1, spec.n_group, per_group).topk(best, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=spec.topk_group, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    return mask.unsqueeze(-1).expand(-1, spec.n_group, per_group).reshape(-1, spec.num_experts).bool()


def _group_limited(spec: MoESpec, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2: groups ranked by their best expert; experts outside the chosen groups score 0."""
    masked = scores.masked_fill(~_group_mask(spec, scores, best=1), 0.0)
    return torch.topk(masked, k=spec.top_k, dim=-1, sorted=False)


def _noaux_tc(spec: MoESpec, scores: torch.Tensor, correction: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3: experts chosen by score + correction bias, in the groups whose two best such scores
    sum highest; weighted by their uncorrected scores."""
    choice = scores if correction is None else scores + correction
    choice = choice.masked_fill(~_group_mask(spec, choice, best=2), float("-inf"))
    ids = torch.topk(choice, k=spec.top_k, dim=-1, sorted=False)[1]
    return scores.gather(1, ids), ids
