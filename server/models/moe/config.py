"""What a mixture-of-experts model's config.json says about its experts, parsed and checked once
(`parse_moe`: a ValueError names each key pdserve does not implement). The router is transformers'
for each family:
- Mixtral: softmax, the top-k renormalised; Qwen2/3-MoE: softmax, renormalised when `norm_topk_prob`.
- DeepSeek-V2: softmax; `topk_method` greedy or group_limited_greedy; weights x `routed_scaling_factor`.
- DeepSeek-V3 and GLM-4.5 (noaux_tc): sigmoid; experts chosen by score + `e_score_correction_bias`
  inside the best `topk_group` groups, weighted by their plain scores, renormalised, x the factor.
DeepSeek's `moe_layer_freq` must be 1 (transformers ignores it); training-only keys and `ep_size` (a
deployment choice) change nothing at inference and are ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ExpertNames:
    """HF tensor names of a sparse layer, relative to `model.layers.{i}.`."""

    block: str = "mlp."  # or "block_sparse_moe." (Mixtral)
    gate: str = "gate_proj"  # an expert's projections (Mixtral: w1, w3, w2)
    up: str = "up_proj"
    down: str = "down_proj"
    shared: str = ""  # the shared expert's module: "shared_expert." (Qwen2-MoE), "shared_experts." (DeepSeek)


MIXTRAL_NAMES = ExpertNames("block_sparse_moe.", "w1", "w3", "w2")


@dataclass(frozen=True)
class MoESpec:
    num_experts: int  # routed experts
    top_k: int  # experts per token
    intermediate_size: int  # one routed expert's (a tensor-parallel rank's share once sharded)
    sparse_layers: tuple[bool, ...]  # per layer: a MoE block (True) or the dense MLP (False)
    names: ExpertNames
    scoring: str = "softmax"  # or "sigmoid"
    topk_method: str = "greedy"  # or "group_limited_greedy", "noaux_tc"
    n_group: int = 1  # expert groups (group-limited top-k), each num_experts // n_group experts
    topk_group: int = 1  # groups a token may pick experts from
    norm_topk_prob: bool = False  # renormalise the top-k weights to sum to 1
    routed_scaling_factor: float = 1.0
    score_correction_bias: bool = False  # DeepSeek-V3's `gate.e_score_correction_bias` [num_experts]
    router_float32: bool = False  # the gate's linear in float32 (DeepSeek) or in the model dtype
    round_weights: bool = False  # Qwen: the top-k weights rounded to the model dtype before they scale
    shared_intermediate_size: int = 0  # the shared expert(s) in one MLP; 0 = none
    shared_gate: bool = False  # Qwen2-MoE: sigmoid(shared_expert_gate(x)) scales the shared expert
    local_experts: tuple[int, int] | None = None  # expert parallelism: [start, end) of the experts held here

    def is_sparse(self, layer: int) -> bool:
        return self.sparse_layers[layer]

    @property
    def held_experts(self) -> range:
        """The routed experts this process holds (all of them without expert parallelism)."""
        return range(*self.local_experts) if self.local_experts is not None else range(self.num_experts)

    def sharded(self, size: int, rank: int = 0, *, expert_parallel: bool = False) -> MoESpec:
        """The spec of tensor-parallel rank `rank` of `size`: every expert's intermediate columns split,
        or (`expert_parallel`) whole experts, num_experts / size of them; the shared expert is split."""
        from dataclasses import replace

        shared = self.shared_intermediate_size // size
        if expert_parallel:
            per = self.num_experts // size
            return replace(self, shared_intermediate_size=shared, local_experts=(rank * per, (rank + 1) * per))
        return replace(self, intermediate_size=self.intermediate_size // size, shared_intermediate_size=shared)


class _Keys:
    """config.json values, read from transformers' config (its defaults) with errors that name the key."""

    def __init__(self, raw: dict[str, Any], cfg: Any, model_dir: Path) -> None:
        self.raw, self.cfg, self.where = raw, cfg, f"model {model_dir}: config.json"

    def get(self, *names: str, default: Any = None) -> Any:
        for name in names:
            value = getattr(self.cfg, name, None)
            if value is None:
                value = self.raw.get(name)
            if value is not None:
                return value
        return default

    def refuse(self, key: str, value: Any, why: str) -> ValueError:
        return ValueError(f"{self.where}: {key}: {value!r}: {why}")


def parse_moe(raw: dict[str, Any], cfg: Any, architecture: str, model_dir: Path) -> MoESpec | None:
    """The experts of `architecture`'s config (None: a dense model); see the module docstring."""
    keys = _Keys(raw, cfg, model_dir)
    if architecture == "MixtralForCausalLM":
        return _mixtral(keys)
    if architecture in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        return _qwen(keys, shared=architecture == "Qwen2MoeForCausalLM")
    if architecture in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Glm4MoeForCausalLM"):
        return _deepseek(keys, v3=architecture != "DeepseekV2ForCausalLM")
    return None


def _layers(keys: _Keys) -> int:
    return int(keys.get("num_hidden_layers"))


def _experts(keys: _Keys, *names: str) -> tuple[int, int]:
    num, top_k = int(keys.get(*names, default=0)), int(keys.get("num_experts_per_tok", default=0))
    if num < 1:
        raise keys.refuse(names[0], num, "a mixture-of-experts model needs at least one expert")
    if not 1 <= top_k <= num:
        raise keys.refuse("num_experts_per_tok", top_k, f"must be between 1 and the {num} experts")
    return num, top_k


def _mixtral(keys: _Keys) -> MoESpec:
    num, top_k = _experts(keys, "num_local_experts", "num_experts")
    return MoESpec(num, top_k, int(keys.get("intermediate_size")), (True,) * _layers(keys), MIXTRAL_NAMES,
                   norm_topk_prob=True)


def _qwen(keys: _Keys, *, shared: bool) -> MoESpec:
    num, top_k = _experts(keys, "num_experts", "num_local_experts")
    if keys.get("use_sliding_window", default=False):
        raise keys.refuse("use_sliding_window", True, "sliding windows are not supported for Qwen MoE models "
                          "(transformers versions disagree on which layers they apply to)")
    step = int(keys.get("decoder_sparse_step", default=1))
    if step < 1:
        raise keys.refuse("decoder_sparse_step", step, "must be at least 1")
    dense = set(keys.get("mlp_only_layers", default=[]) or [])
    sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(_layers(keys)))
    shared_size = int(keys.get("shared_expert_intermediate_size", default=0)) if shared else 0
    return MoESpec(num, top_k, int(keys.get("moe_intermediate_size")), sparse,
                   ExpertNames(shared="shared_expert."),
                   norm_topk_prob=bool(keys.get("norm_topk_prob", default=False)), round_weights=True,
                   shared_intermediate_size=shared_size, shared_gate=shared_size > 0)


def _deepseek(keys: _Keys, *, v3: bool) -> MoESpec:
    num, top_k = _experts(keys, "n_routed_experts", "num_local_experts", "num_experts")
    scoring = keys.get("scoring_func", default="sigmoid" if v3 else "softmax")
    if scoring != ("sigmoid" if v3 else "softmax"):
        raise keys.refuse("scoring_func", scoring, f"this architecture scores experts with "
                          f"{'sigmoid' if v3 else 'softmax'} (transformers' math; no other is supported)")
    method = keys.get("topk_method", default="noaux_tc" if v3 else "greedy")
    allowed = ("noaux_tc",) if v3 else ("greedy", "group_limited_greedy")
    if method not in allowed:
        raise keys.refuse("topk_method", method, f"supported for this architecture: {list(allowed)}")
    norm = bool(keys.get("norm_topk_prob", default=v3))
    if norm and not v3:
        raise keys.refuse("norm_topk_prob", True, "DeepSeek-V2's top-k weights are not renormalised "
                          "(transformers ignores this key and the original code drops the scaling factor)")
    freq = int(keys.get("moe_layer_freq", default=1))
    if freq != 1:
        raise keys.refuse("moe_layer_freq", freq, "only 1 (every layer past first_k_dense_replace) is "
                          "supported: transformers ignores this key")
    n_group, topk_group = _groups(keys, num, grouped=method != "greedy", per_group_min=2 if v3 else 1)
    first_dense = int(keys.get("first_k_dense_replace", default=0))
    shared = int(keys.get("n_shared_experts", default=0) or 0)
    size = int(keys.get("moe_intermediate_size"))
    return MoESpec(num, top_k, size, tuple(i >= first_dense for i in range(_layers(keys))),
                   ExpertNames(shared="shared_experts."),
                   scoring=scoring, topk_method=method, n_group=n_group, topk_group=topk_group,
                   norm_topk_prob=norm, routed_scaling_factor=float(keys.get("routed_scaling_factor", default=1.0)),
                   score_correction_bias=v3, router_float32=True, shared_intermediate_size=size * shared)


def _groups(keys: _Keys, num: int, *, grouped: bool, per_group_min: int) -> tuple[int, int]:
    if not grouped:
        return 1, 1
    n_group, topk_group = keys.get("n_group"), keys.get("topk_group")
    if not isinstance(n_group, int) or n_group < 1 or num % n_group or num // n_group < per_group_min:
        raise keys.refuse("n_group", n_group, f"must divide the {num} experts into groups of at least "
                          f"{per_group_min}")
    if not isinstance(topk_group, int) or not 1 <= topk_group <= n_group:
        raise keys.refuse("topk_group", topk_group, f"must be between 1 and n_group ({n_group})")
    if keys.get("num_experts_per_tok") > topk_group * (num // n_group):
        raise keys.refuse("num_experts_per_tok", keys.get("num_experts_per_tok"),
                          f"more than the {topk_group} groups of {num // n_group} experts a token may use")
    return n_group, topk_group
