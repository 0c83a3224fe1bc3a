"""Our compact Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, and the mixture-of-experts
Mixtral, Qwen2-MoE, Qwen3-MoE, GLM-4.5) in plain torch.

Math follows transformers' modeling code step for step (RMSNorm in float32, rotate_half RoPE, Qwen3's
and GLM-4.5's per-head q/k norm before RoPE). Weights fuse once at load: q/k/v, and gate/up. The model
is stateless between steps: the KV cache is reached only through the attention backend, which also
applies RoPE (so a GPU backend fuses it with the cache write). The residual add is fused into the
next RMSNorm. A tensor-parallel rank's model holds its weight slices and meets the other ranks only
through `parallel` (`SingleRank` with one rank, which adds nothing).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from server.models.attention import AttentionBackend
from server.models.fp8.weight import cat_rows
from server.models.mla_attention import TorchLatentAttention
from server.models.mlp import DenseMLP, FeedForward, load_mlp
from server.models.model_spec import ModelSpec
from server.models.moe import build_moe
from server.models.ops import TorchOps, Weight
from server.models.parallel.context import ParallelContext, SingleRank
from server.models.rope import Rotary

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints saved


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: Weight  # [(heads + 2 * kv_heads) * head_dim, hidden]; linear weights are float or FP8 (fp8/)
    qkv_bias: torch.Tensor | None  # [(heads + 2 * kv_heads) * head_dim]
    q_norm: torch.Tensor | None  # [head_dim] (Qwen3)
    k_norm: torch.Tensor | None  # [head_dim] (Qwen3)
    o: Weight  # [hidden, heads * head_dim]
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor  # [hidden]
    mlp: FeedForward  # a DenseMLP, or a MoEBlock on a mixture-of-experts model's sparse layers

    @property
    def dense_mlp(self) -> DenseMLP | None:
        return self.mlp if isinstance(self.mlp, DenseMLP) else None


class DecoderStack:
    """The residual stream of every decoder family: embed, per layer attention and feed-forward, each
    added with the next norm fused in, then the wanted rows' logits. A family gives `_layer(weights,
    i)` and `_attention(i, layer, x, cos, sin, meta)`. `spec`: the shape computed here (a rank's own
    heads and FFN columns, `parallel.shard.local_spec`)."""

    def __init__(self, spec: ModelSpec, tensors: dict[str, Weight], attention: AttentionBackend | TorchLatentAttention,
                 *, dtype: torch.dtype, device: torch.device, ops: TorchOps | None = None,
                 parallel: ParallelContext | None = None) -> None:
        self.spec = spec
        self.attention = attention
        self.ops = ops or TorchOps(spec.rms_norm_eps)
        self.parallel = parallel or SingleRank()
        self.dtype = dtype
        self.rotary = Rotary(spec, device)  # an MLA spec's head_dim is qk_rope_head_dim
        weights = _WeightTable(spec, tensors)
        self.embed = weights.take("model.embed_tokens.weight")  # [vocab, hidden]
        self.layers = [self._layer(weights, i) for i in range(spec.num_layers)]
        self.final_norm = weights.take("model.norm.weight")
        self.lm_head = weights.lm_head(self.embed)  # [vocab, hidden]
        weights.check_all_used()

    def _feed_forward(self, w: _WeightTable, i: int, bias: bool = False) -> FeedForward:
        """Layer i's `MoEBlock` on a mixture-of-experts model's sparse layers, else its dense MLP."""
        moe = self.spec.moe
        if moe is not None and moe.is_sparse(i):
            return build_moe(moe, w, i)
        return load_mlp(w, f"model.layers.{i}.mlp.", bias=bias)

    @torch.no_grad()
    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, meta: object,
                logit_rows: torch.Tensor) -> torch.Tensor:
        """token_ids, positions [T] int64; logit_rows [N] rows wanted -> logits [N, vocab] float32."""
        ops, tp = self.ops, self.parallel
        h = tp.embed(token_ids, self.embed)  # [T, hidden]: the residual stream
        cos, sin = self.rotary.cos_sin(positions, self.dtype)  # [T, rotary_dim] each
        x = ops.rms_norm(h, self.layers[0].input_norm)
        for i, layer in enumerate(self.layers):
            x = ops.add_rms_norm(tp.reduce(self._attention(i, layer, x, cos, sin, meta)), h, layer.post_norm)
            after = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.final_norm
            x = ops.add_rms_norm(tp.reduce(layer.mlp(x, ops)), h, after)  # h += mlp; x = next norm of h
        return tp.logits(x.index_select(0, logit_rows), self.lm_head).float()  # [N, vocab]


class LlamaModel(DecoderStack):
    attention: AttentionBackend

    def _attention(self, i: int, layer: LayerWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   meta: object) -> torch.Tensor:
        t, d, heads = x.shape[0], self.spec.head_dim, self.spec.num_heads
        qkv = self.ops.linear(x, layer.qkv, layer.qkv_bias).view(t, -1, d)  # [T, heads + 2 * kv_heads, head_dim]
        if layer.q_norm is not None:
            qkv = self.ops.qk_norm(qkv, layer.q_norm, layer.k_norm, heads, self.spec.num_kv_heads)
        out = self.attention.forward(i, qkv, cos, sin, meta)  # [T, heads, head_dim]; RoPE inside
        return self.ops.linear(out.reshape(t, heads * d), layer.o, layer.o_bias)

    def _layer(self, w: _WeightTable, i: int) -> LayerWeights:
        spec, p = self.spec, f"model.layers.{i}."
        att = p + "self_attn."
        qkv = [w.take(f"{att}{n}_proj.weight") for n in "qkv"]
        qkv_bias = [w.take(f"{att}{n}_proj.bias") for n in "qkv"] if spec.qkv_bias else None
        return LayerWeights(
            input_norm=w.take(p + "input_layernorm.weight"),
            qkv=cat_rows(qkv), qkv_bias=torch.cat(qkv_bias) if qkv_bias else None,
            q_norm=w.maybe(att + "q_norm.weight", spec.qk_norm),
            k_norm=w.maybe(att + "k_norm.weight", spec.qk_norm),
            o=w.take(att + "o_proj.weight"), o_bias=w.maybe(att + "o_proj.bias", spec.o_bias),
            post_norm=w.take(p + "post_attention_layernorm.weight"),
            mlp=self._feed_forward(w, i, bias=spec.mlp_bias),
        )


class _WeightTable:
    """HF tensor names -> tensors, taken out of the caller's dict as the model takes them: a part
    fused into another tensor (q|k|v, gate|up, stacked experts) is freed as soon as it is fused, so
    loading holds one layer's copies at a time beside the KV pool, not the whole model's. What is
    left at the end is reported."""

    def __init__(self, spec: ModelSpec, tensors: dict[str, Weight]) -> None:
        self.spec = spec
        for name in [k for k in tensors if k.endswith(_IGNORED_SUFFIXES)]:
            del tensors[name]
        self.tensors = tensors

    def take(self, name: str) -> Weight:
        if name not in self.tensors:
            raise ValueError(f"model {self.spec.model_dir}: weight {name!r} is missing")
        return self.tensors.pop(name)

    def has(self, name: str) -> bool:
        return name in self.tensors

    def maybe(self, name: str, wanted: bool) -> Weight | None:
        return self.take(name) if wanted else None

    def lm_head(self, embed: torch.Tensor) -> torch.Tensor:
        if "lm_head.weight" in self.tensors:
            return self.take("lm_head.weight")
        if self.spec.tie_word_embeddings:
            return embed
        raise ValueError(f"model {self.spec.model_dir}: weight 'lm_head.weight' is missing "
                         "(and tie_word_embeddings is false)")

    def check_all_used(self) -> None:
        extra = sorted(self.tensors)
        if extra:
            raise ValueError(f"model {self.spec.model_dir}: unexpected weights {extra[:8]} "
                             f"({len(extra)} in all) for {self.spec.architecture}")
