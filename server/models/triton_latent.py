"""GPU attention over a latent (MLA) cache: Triton decode for steps of one-token rows, CUDA-graph
capturable through `StaticDecodePlan`; a step with prefill chunks runs the torch MLA
(mla_attention.py) over the same cache.

A decode step's plan is the dense backend's (`TritonPagedAttention.plan` with one kv head: the
tokens' slots and offsets, block tables, lengths, window starts), so the decode graphs take this
backend as they take the dense one. Each layer writes the new latent rows (`write_latent`) and runs
the split-K latent decode (`latent_decode`). An FP8 latent cache stays on the torch MLA.
"""

from __future__ import annotations

import torch

from server.models.attention import PagedKV, StepLayout
from server.models.kernels.latent import latent_decode, write_latent
from server.models.mla_attention import TorchLatentAttention
from server.models.mla_spec import MLASpec
from server.models.triton_attention import TritonPagedAttention, WindowMeta


def supports(mla: MLASpec, cache_dtype: torch.dtype) -> bool:
    """The latent kernels take this model and cache: R and P powers of two (tl.arange), P >= 16
    (tl.dot), a float cache (an FP8 latent stays on the torch MLA)."""
    r, p = mla.kv_lora_rank, mla.qk_rope_head_dim
    return not (r & (r - 1) or p & (p - 1)) and p >= 16 and cache_dtype != torch.float8_e4m3fn


class TritonLatentAttention(TritonPagedAttention):
    def __init__(self, kv: PagedKV, num_layers: int, num_heads: int, kv_lora_rank: int, scale: float,
                 dtype: torch.dtype, *, max_seq_len: int) -> None:
        self.latents = [kv.layer_latent(i) for i in range(num_layers)]  # [slots, tpb, rank + rope]
        # head_dim: the output's width per head (the decode scratch's rows)
        self._shape(kv, num_layers, num_heads, 1, kv_lora_rank, scale, max_seq_len, self.latents[0].device)
        self.torch = TorchLatentAttention(kv, num_layers, num_heads, kv_lora_rank, scale, dtype)

    def plan(self, layout: StepLayout, positions: torch.Tensor) -> dict:
        if layout.num_decode == len(layout.seqs):
            return super().plan(layout, positions)
        return self.torch.plan(layout, positions)

    def forward(self, layer: int, query: torch.Tensor, latent: torch.Tensor, meta: dict) -> torch.Tensor:
        """query [T, heads, rank + rope], latent [T, rank + rope] -> [T, heads, rank] (the torch MLA's
        contract); writes `latent` into the cache first."""
        plan = meta[self.windows[layer]]
        if not isinstance(plan, WindowMeta):
            return self.torch.forward(layer, query, latent, meta)
        cache, d = self.latents[layer], plan.decode
        write_latent(latent, cache, plan.slot, plan.offset)
        out = torch.empty(query.shape[0], self.num_heads, self.head_dim, dtype=query.dtype, device=query.device)
        if d is not None:
            latent_decode(query, cache, d.block_table, d.seq_lens, d.lo, out, self.scale, d.splits, d.scratch)
        return out
