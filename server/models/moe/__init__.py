"""Mixture-of-experts feed-forward blocks (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2/V3).

Public API:

- `parse_moe(raw: dict, cfg: PretrainedConfig, architecture: str, model_dir: Path) -> MoESpec | None`
  (config.py): the experts of a config.json (`raw`: the file as read, `cfg`: transformers' config of
  it); None for a dense architecture; a ValueError naming the key pdserve does not implement.
  `load_spec` stores it as `ModelSpec.moe`.
- `MoESpec` (config.py): frozen; `num_experts`, `top_k`, `intermediate_size` (one routed expert's),
  `is_sparse(layer) -> bool`, the router's options (`scoring`, `topk_method`, `n_group`,
  `topk_group`, `norm_topk_prob`, `routed_scaling_factor`, `score_correction_bias`), the shared
  expert's (`shared_intermediate_size`, `shared_gate`), and `sharded(tp_size)`.
- `build_moe(spec: MoESpec, weights: WeightSource, layer: int, *, experts=None) -> MoEBlock`
  (block.py): layer `layer`'s block, its tensors taken by HF name from `weights` (an object with
  `take(name)` and `has(name)`, like the model's weight table).
- `MoEBlock.__call__(x: Tensor [T, hidden], ops: ModelOps) -> Tensor [T, hidden]` (block.py): the
  routed experts' weighted sum plus the shared expert's output. With tensor parallelism it is the
  rank's partial sum, which the caller all-reduces like a dense MLP's (`ParallelContext.reduce`).
  `MoEBlock.take_load() -> Tensor [E] int64`: tokens routed to each expert since the last call.
- `moe_blocks(model) -> dict[int, MoEBlock]`: layer -> block, of a model whose `layers[i].mlp` holds
  them; the runner sets their `experts` (the Triton path: server/models/kernels/moe.py) and reads
  their load through `ExpertLoad` (load.py: /metrics' `pdserve_moe_expert_tokens_total`).
- `route(spec, x, gate, correction=None) -> (weights [T, top_k] float32, ids [T, top_k] int64)`
  (router.py): the gate alone.
- `load_mlp(weights, prefix) -> DenseMLP` (server/models/mlp.py): a dense layer's MLP (DeepSeek's
  first `first_k_dense_replace` layers, Qwen's `mlp_only_layers`), called the same way.

The forward has no host synchronisation on CUDA (experts.py says how), so it runs inside CUDA graphs.
"""

from server.models.mlp import DenseMLP, WeightSource, load_mlp
from server.models.moe.block import MoEBlock, build_moe, moe_blocks
from server.models.moe.config import MOE_ARCHITECTURES, MoESpec, parse_moe
from server.models.moe.router import route

__all__ = ["MOE_ARCHITECTURES", "DenseMLP", "MoEBlock", "MoESpec", "WeightSource", "build_moe", "load_mlp",
           "moe_blocks", "parse_moe", "route"]
