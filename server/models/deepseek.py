"""DeepSeek-V2/V3 decoder in plain torch: multi-head latent attention (MLA) over a latent KV cache.

Math follows transformers' DeepseekV2/V3 code (q through q_proj or the q_a/q_b low rank; the latent
`c` and the shared rope key `k_pe` from kv_a_proj_with_mqa; the q_a and kv_a norms with eps 1e-6,
transformers' default for them). The cache holds [c, k_pe] per token and layer; K and V are never
expanded: kv_b_proj is split at load into W_uk and W_uv, a head's query becomes [q_nope @ W_uk, q_pe]
and its output (the weighted sum of `c`) @ W_uv^T (server/models/mla_attention.py). Tensor
parallelism: each rank holds its heads' slices of q, kv_b and o; the latent path is whole on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from server.models.llama import DecoderStack, _WeightTable
from server.models.mla_attention import TorchLatentAttention
from server.models.mla_spec import MLASpec
from server.models.mlp import FeedForward
from server.models.ops import Weight

LORA_NORM_EPS = 1e-6  # DeepseekV2/V3RMSNorm's default: q_a_layernorm and kv_a_layernorm take no eps


@dataclass
class MLAWeights:
    q: Weight | None  # q_proj [heads * qk_head_dim, hidden] (q_lora_rank None)
    q_a: Weight | None  # [q_lora_rank, hidden]
    q_a_norm: torch.Tensor | None  # [q_lora_rank]
    q_b: Weight | None  # [heads * qk_head_dim, q_lora_rank]
    kv_a: Weight  # [kv_lora_rank + qk_rope_head_dim, hidden]
    kv_a_norm: torch.Tensor  # [kv_lora_rank]
    w_uk: torch.Tensor  # [heads, qk_nope_head_dim, kv_lora_rank]
    w_uv: torch.Tensor  # [heads, v_head_dim, kv_lora_rank]
    o: Weight  # [hidden, heads * v_head_dim]


@dataclass
class DeepseekLayer:
    input_norm: torch.Tensor
    attn: MLAWeights
    post_norm: torch.Tensor
    mlp: FeedForward  # a DenseMLP (layers before first_k_dense_replace) or the MoE block (server/models/moe/)


class DeepseekModel(DecoderStack):
    attention: TorchLatentAttention

    @property
    def mla(self) -> MLASpec:
        return self.spec.mla

    def _attention(self, i: int, layer: DeepseekLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   meta: object) -> torch.Tensor:
        w, mla, ops, t = layer.attn, self.mla, self.ops, x.shape[0]
        if w.q is not None:
            q = ops.linear(x, w.q, None)
        else:
            q = ops.linear(ops.rms_norm(ops.linear(x, w.q_a, None), w.q_a_norm, LORA_NORM_EPS), w.q_b, None)
        q = q.view(t, -1, mla.qk_head_dim)  # [T, heads, nope + rope]
        kv = ops.linear(x, w.kv_a, None)  # [T, rank + rope]: c, then k_pe
        q_pe, k_pe = ops.latent_rope(q, kv, cos, sin, mla.rope_interleave)
        c = ops.rms_norm(kv[:, :mla.kv_lora_rank], w.kv_a_norm, LORA_NORM_EPS)  # [T, rank]
        q_nope = q[..., :mla.qk_nope_head_dim]
        query = torch.cat((torch.einsum("thn,hnr->thr", q_nope, w.w_uk), q_pe), -1)  # [T, heads, rank + rope]
        out = self.attention.forward(i, query, torch.cat((c, k_pe), -1), meta)  # [T, heads, rank]
        out = torch.einsum("thr,hvr->thv", out, w.w_uv).reshape(t, -1)  # [T, heads * v]
        return ops.linear(out, w.o, None)

    def _layer(self, w: _WeightTable, i: int) -> DeepseekLayer:
        p = f"model.layers.{i}."
        return DeepseekLayer(input_norm=w.take(p + "input_layernorm.weight"),
                             attn=self._mla_weights(w, p + "self_attn."),
                             post_norm=w.take(p + "post_attention_layernorm.weight"), mlp=self._feed_forward(w, i))

    def _mla_weights(self, w: _WeightTable, att: str) -> MLAWeights:
        mla, lora = self.mla, self.mla.q_lora_rank is not None
        kv_b = w.take(att + "kv_b_proj.weight")  # [heads * (nope + v), rank]: float (not an FP8 linear)
        kv_b = kv_b.view(-1, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
        w_uk, w_uv = kv_b.split([mla.qk_nope_head_dim, mla.v_head_dim], 1)
        return MLAWeights(
            q=w.maybe(att + "q_proj.weight", not lora), q_a=w.maybe(att + "q_a_proj.weight", lora),
            q_a_norm=w.maybe(att + "q_a_layernorm.weight", lora), q_b=w.maybe(att + "q_b_proj.weight", lora),
            kv_a=w.take(att + "kv_a_proj_with_mqa.weight"), kv_a_norm=w.take(att + "kv_a_layernorm.weight"),
            w_uk=w_uk.contiguous(), w_uv=w_uv.contiguous(), o=w.take(att + "o_proj.weight"))
