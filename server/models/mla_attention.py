"""Paged attention over a latent KV cache (multi-head latent attention, DeepSeek-V2/V3), in torch.

The cache holds one row a token and layer: the normalized compressed KV `c` and the roped shared key
`k_pe`. With the up-projections absorbed (server/models/deepseek.py) a head's query is
[q_nope @ W_uk, q_pe] and its output the softmax-weighted sum of the tokens' `c`, so every head reads
the same keys: one "kv head", the heads as query rows, over the K/V backend's plan with one plane per
layer. An FP8 cache stores e4m3(latent / scale), one scale per layer: reads widen the rows exactly,
fold the scale into the softmax scale and multiply the output by it.
"""

from __future__ import annotations

import torch

from kvcache.layout import inverse_scale, quantize_fp8
from server.models import attention
from server.models.attention import LayerUnits, PagedKV, SdpaPaged, WindowPlan, as_stored


def latent_units(window: int, latent: torch.Tensor) -> LayerUnits:
    """Units views of a layer's latent (`KVCacheManager.layer_latent`: [slots, tpb, width])."""
    slots, tpb, width = latent.shape
    if latent.stride()[1:] != (width, 1) or latent.stride(0) % (tpb * width):
        raise ValueError(f"latent cache layout not supported: {tuple(latent.shape)} strides {latent.stride()}")
    return attention.units_view(window, latent, planes=1)


class TorchLatentAttention(SdpaPaged):
    """Attention over the latent cache; `plan` once per step, `forward` per layer."""

    def __init__(self, kv: PagedKV, num_layers: int, num_heads: int, kv_lora_rank: int, scale: float,
                 dtype: torch.dtype) -> None:
        layers = [latent_units(kv.layer_window(i), kv.layer_latent(i)) for i in range(num_layers)]
        super().__init__(kv, layers, num_heads, 1, scale, dtype, planes=1)
        self.rank = kv_lora_rank
        self.scales = [kv.layout.format.layer_scales(i)[0] for i in range(num_layers)]  # the latent's, per layer (FP8)
        device = layers[0].blocks.device
        self._inverse = [torch.tensor(inverse_scale(s), device=device) for s in self.scales] if self.quantized else []

    def forward(self, layer: int, query: torch.Tensor, latent: torch.Tensor,
                meta: dict[int, WindowPlan]) -> torch.Tensor:
        """query [T, heads, width] (absorbed q_nope, then roped q_pe), latent [T, width] (the new
        tokens' normalized c, then roped k_pe) -> [T, heads, kv_lora_rank]: per head, the
        attention-weighted sum of the tokens' c. Writes `latent` into the cache first."""
        cache = self.layers[layer]
        plan = meta[cache.window]
        stored = quantize_fp8(latent, self._inverse[layer]).view(torch.uint8) if self.quantized \
            else latent.to(cache.tokens.dtype)
        as_stored(cache.tokens).index_put_((plan.write_rows[:, 0],), stored)
        out = self._attend(query, plan, cache.blocks, self.scales[layer])  # 1.0 unless FP8
        return out * self.scales[layer] if self.quantized else out

    def _keys_values(self, blocks: torch.Tensor, units: torch.Tensor, num_seqs: int,
                     dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """blocks [units, tpb, width], units [num_seqs * nb] -> the rows [num_seqs, 1, nb * tpb, width] in
        `dtype` as the keys, their first kv_lora_rank values (the `c`) as the values: every head, one
        latent "head", reads the same."""
        keys = attention.gather_units(blocks, units, dtype).view(num_seqs, 1, -1, blocks.shape[2])
        return keys, keys[..., :self.rank]
