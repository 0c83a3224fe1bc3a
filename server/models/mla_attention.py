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
import torch.nn.functional as F

from kvcache.layout import inverse_scale, quantize_fp8
from server.models import attention
from server.models.attention import Attend, LayerUnits, PagedKV, SdpaPaged, WindowPlan, as_stored


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
        super().__init__(kv, layers, num_heads, scale, dtype, planes=1)
        self.num_kv_heads, self.rank = 1, kv_lora_rank
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
        scale = self.scales[layer] if self.quantized else 1.0
        out = plan.attend(query, lambda q, a: self._decode(q, cache.blocks, a, scale),
                          lambda q, a: self._prefill(q, cache.blocks, a, scale))
        return out * scale if self.quantized else out

    def _decode(self, q: torch.Tensor, blocks: torch.Tensor, a: Attend, scale: float) -> torch.Tensor:
        """One query per sequence; its heads are the query rows of the one latent "head"."""
        s = q.shape[0]
        keys = _gather(blocks, a.units, s, q.dtype)  # [S, 1, L, width]
        out = F.scaled_dot_product_attention(q[:, None], keys, keys[..., :self.rank], attn_mask=a.mask,
                                             scale=self.scale * scale)  # [S, 1, heads, rank]
        return out[:, 0]

    def _prefill(self, q: torch.Tensor, blocks: torch.Tensor, a: Attend, scale: float) -> torch.Tensor:
        keys = _gather(blocks, a.units, 1, q.dtype)  # [1, 1, L, width]
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, keys[..., :self.rank],
                                             attn_mask=a.mask, scale=self.scale * scale,
                                             enable_gqa=True)  # [1, heads, Q, rank]
        return out[0].transpose(0, 1)


def _gather(blocks: torch.Tensor, units: torch.Tensor, num_seqs: int, dtype: torch.dtype) -> torch.Tensor:
    """blocks [units, tpb, width], units [num_seqs * nb] -> [num_seqs, 1, nb * tpb, width] in `dtype`."""
    return attention.gather_units(blocks, units, dtype).view(num_seqs, 1, -1, blocks.shape[2])
