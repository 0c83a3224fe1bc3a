"""A sparse layer's feed-forward block: the gate, the routed experts, the shared expert(s).

`build_moe` loads one layer's block by HF names, from either layout a checkpoint ships: one tensor
per expert and projection (`experts.{e}.{gate,up,down}.weight`) or transformers 5's stacked
`experts.gate_up_proj` [E, 2I, hidden] and `experts.down_proj` [E, hidden, I]. Expert weights are
float or stacked `Fp8Weight`s; a layer whose experts mix the two is dequantized.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from server.models.fp8.weight import Fp8Weight, cat_rows, stack_experts
from server.models.mlp import DenseMLP, WeightSource, load_mlp
from server.models.moe.config import MoESpec
from server.models.moe.dispatch import AllToAllDispatch
from server.models.moe.experts import ExpertsFn, default_experts, expert_load
from server.models.moe.router import gate_logits, route
from server.models.ops import TorchOps, Weight

# (spec, gate logits [T, E], x, load [E]) -> (weights [T, top_k] float32, ids [T, top_k]), counting into load
RouteFn = Callable[[MoESpec, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class MoEBlock:
    spec: MoESpec  # a tensor-parallel rank's: `intermediate_size` is its share of each expert's
    gate: torch.Tensor  # [E, hidden]: the router's weight
    correction: torch.Tensor | None  # [E] float32: DeepSeek-V3's e_score_correction_bias
    gate_up: Weight  # [E, 2I, hidden]: a float tensor or a stacked Fp8Weight
    down: Weight  # [E, hidden, I]
    shared: DenseMLP | None = None  # the shared expert(s), one MLP
    shared_gate: torch.Tensor | None = None  # [1, hidden]: Qwen2-MoE's sigmoid gate of the shared expert
    experts: ExpertsFn = field(default=None)  # type: ignore[assignment]  # set from the device when None
    load: torch.Tensor = field(default=None)  # type: ignore[assignment]  # [E] int64: tokens routed, counted on the device
    dispatch: AllToAllDispatch | None = None  # expert parallelism by all-to-all (else every rank routes every token)
    fused_route: RouteFn | None = None  # the Triton path's top-k, rounding and load count (kernels/route.py)

    def __post_init__(self) -> None:
        if self.experts is None:
            self.experts = default_experts(self.gate_up.device)
        if self.load is None:
            self.load = torch.zeros(self.spec.num_experts, dtype=torch.int64, device=self.gate_up.device)

    def __call__(self, x: torch.Tensor, ops: TorchOps) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]: sum of the routed experts' outputs (and the shared expert's)."""
        weights, ids = self._route(x)  # [T, top_k] each
        if self.dispatch is not None:  # the pairs go to their experts' ranks, and their outputs come back
            out = self.dispatch(x, weights, ids, self._routed)
        else:  # every rank routes every token to the experts it holds (all of them on one rank)
            out = self._routed(x, *_held(self.spec.local_experts, weights, ids))
        if self.shared is not None:
            shared = self.shared(x, ops)
            if self.shared_gate is not None:
                shared = torch.sigmoid(ops.linear(x, self.shared_gate, None)) * shared
            out = out + shared
        return out

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fused_route is not None:
            return self.fused_route(self.spec, gate_logits(self.spec, x, self.gate), x, self.load)
        weights, ids = route(self.spec, x, self.gate, self.correction)
        if self.spec.round_weights:  # as transformers' Qwen routers hand them over (a no-op in float32)
            weights = weights.to(x.dtype).float()
        self.load += expert_load(ids, self.spec.num_experts)
        return weights, ids

    def _routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate_up, self.down, weights, ids)


def _held(held: tuple[int, int] | None, weights: torch.Tensor,
          ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert parallelism (`held`: [start, end) of the experts here; None: all, the pairs unchanged):
    ids of the experts held here as local indices (0..n-1); a pair routed to another rank's expert
    gets the index n (no expert: the implementations skip it) and weight 0. The ranks' outputs are
    summed like tensor-parallel partial sums."""
    if held is None:
        return weights, ids
    local = ids - held[0]
    mine = (local >= 0) & (local < held[1] - held[0])
    return weights * mine, local.masked_fill(~mine, held[1] - held[0])


def moe_blocks(model: object) -> dict[int, MoEBlock]:
    """layer -> MoE block, of a model whose `layers[i].mlp` is its feed-forward block (LlamaModel's)."""
    layers = enumerate(getattr(model, "layers", []))
    return {i: layer.mlp for i, layer in layers if isinstance(getattr(layer, "mlp", None), MoEBlock)}


def build_moe(spec: MoESpec, weights: WeightSource, layer: int) -> MoEBlock:
    """Layer `layer`'s MoE block from `weights` (HF names; `spec.is_sparse(layer)` must hold)."""
    names = spec.names
    base = f"model.layers.{layer}."
    stacked = weights.has(base + "mlp.experts.gate_up_proj")  # transformers 5's own layout: always under mlp.
    block = base + ("mlp." if stacked else names.block)
    if stacked:
        gate_up, down = weights.take(block + "experts.gate_up_proj"), weights.take(block + "experts.down_proj")
    else:
        gate_up, down = _per_expert(spec, weights, block)
    gate_up, down = _checked(spec, block, gate_up, down)
    shared = load_mlp(weights, block + names.shared) if spec.shared_intermediate_size else None
    return MoEBlock(
        spec=spec, gate=weights.take(block + "gate.weight"),
        correction=weights.take(block + "gate.e_score_correction_bias").float() if spec.score_correction_bias else None,
        gate_up=gate_up, down=down, shared=shared,
        shared_gate=weights.take(block + "shared_expert_gate.weight") if spec.shared_gate else None)


def _per_expert(spec: MoESpec, weights: WeightSource, block: str) -> tuple[Weight, Weight]:
    n = spec.names
    gate_up, down = [], []
    for e in spec.held_experts:
        prefix = f"{block}experts.{e}."
        gate_up.append(cat_rows([weights.take(f"{prefix}{p}.weight") for p in (n.gate, n.up)]))
        down.append(weights.take(f"{prefix}{n.down}.weight"))
    return stack_experts(gate_up), stack_experts(down)


def _checked(spec: MoESpec, block: str, gate_up: Weight, down: Weight) -> tuple[Weight, Weight]:
    e, i = len(spec.held_experts), spec.intermediate_size
    if gate_up.shape[:2] != (e, 2 * i) or down.shape[0] != e or down.shape[2] != i:
        raise ValueError(f"{block}experts: shapes {tuple(gate_up.shape)} and {tuple(down.shape)} do not fit "
                         f"{e} experts of intermediate size {i}")
    if isinstance(gate_up, Fp8Weight) != isinstance(down, Fp8Weight):  # one FP8 projection: both dequantized
        dtype = down.dtype if isinstance(down, torch.Tensor) else gate_up.dtype
        gate_up, down = (w.dequantize(dtype) if isinstance(w, Fp8Weight) else w for w in (gate_up, down))
    if isinstance(gate_up, Fp8Weight):
        return gate_up, down
    return gate_up.contiguous(), down.contiguous()
