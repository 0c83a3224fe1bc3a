"""`KVFormat`: what one token's cached bytes of one layer are. Made once where a server starts
(server/models/kv_format.py) and passed whole to everything that stores, names or moves KV.

Layouts: "heads", K and V planes of `num_kv_heads` heads (Llama, Mistral, Qwen); "latent", multi-head
latent attention's one plane of one "head" (DeepSeek-V2/V3: the normalized latent, then the roped
shared key), the same on every tensor-parallel rank. FP8 has per-layer scales: k and v (heads), or
`k_scales` only (latent).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcache.kv_scales import checked_scales, scales_digest

FP8 = torch.float8_e4m3fn  # the quantized KV element type (`kv_cache_config.dtype: fp8`)
LAYOUTS = ("heads", "latent")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}={value!r}: must be an integer > 0")


@dataclass(frozen=True)
class KVFormat:
    dtype: torch.dtype  # the stored element type
    num_kv_heads: int  # heads per token of a layer (a tensor-parallel rank's own; latent: 1)
    head_dim: int  # values per head (latent: kv_lora_rank + qk_rope_head_dim)
    layout: str = "heads"  # "heads" (K and V planes) or "latent" (one plane)
    k_scales: tuple[float, ...] = ()  # FP8: per layer, K (latent: the latent) is stored as K / k_scale
    v_scales: tuple[float, ...] = ()  # FP8 heads layout: per layer, V / v_scale

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"KVFormat.dtype={self.dtype!r}: must be a torch.dtype")
        if self.layout not in LAYOUTS:
            raise ValueError(f"KVFormat.layout={self.layout!r}: must be one of {LAYOUTS}")
        positive_int("KVFormat.num_kv_heads", self.num_kv_heads)
        positive_int("KVFormat.head_dim", self.head_dim)
        if self.latent and self.num_kv_heads != 1:
            raise ValueError(f"KVFormat: a latent cache has one head, not {self.num_kv_heads}")
        for name in ("k_scales", "v_scales"):
            values = tuple(getattr(self, name))
            object.__setattr__(self, name, checked_scales(f"KVFormat.{name}", values, len(values)))
        if not self.quantized and (self.k_scales or self.v_scales):
            raise ValueError(f"KVFormat: k/v scales are for an FP8 cache, not {dtype_name(self.dtype)}")
        if self.latent and self.v_scales:
            raise ValueError("KVFormat: a latent cache has one scale per layer (k_scales), no v_scales")

    @property
    def latent(self) -> bool:
        return self.layout == "latent"

    @property
    def quantized(self) -> bool:
        """An FP8 cache: blocks hold e4m3 values with per-layer scales."""
        return self.dtype == FP8

    @property
    def planes(self) -> int:
        return 1 if self.latent else 2

    @property
    def element_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def bytes_per_token(self, num_layers: int) -> int:
        return num_layers * self.planes * self.num_kv_heads * self.head_dim * self.element_bytes

    def slot_shape(self, num_layers: int, tokens_per_block: int) -> tuple[int, ...]:
        return (num_layers, self.planes, tokens_per_block, self.num_kv_heads, self.head_dim)

    @property
    def id(self) -> str:
        """The whole format in one string (FP8: with a digest of the scales); KV moves only between equals."""
        base = f"{self.layout}:{dtype_name(self.dtype)}:{self.num_kv_heads}x{self.head_dim}"
        return f"{base}:{scales_digest(self.k_scales, self.v_scales)}" if self.quantized else base

    @property
    def hash_namespace(self) -> str:
        """What refines the block hashes' salt (`kv_format_salt`): "" for K/V heads in the model's dtype,
        else layout, dtype and scales, so blocks of two formats never match in any tier."""
        if not self.quantized and not self.latent:
            return ""
        base = f"{dtype_name(self.dtype)}:{scales_digest(self.k_scales, self.v_scales)}" if self.quantized \
            else dtype_name(self.dtype)
        return f"latent:{base}" if self.latent else base

    def layer_scales(self, layer: int) -> tuple[float, float]:
        """(k scale, v scale) of one layer (latent: (its scale, 1.0)); (1.0, 1.0) unquantized."""
        if not self.quantized:
            return 1.0, 1.0
        return self.k_scales[layer], 1.0 if self.latent else self.v_scales[layer]

    def block_scales(self, layers: tuple[int, ...] | list[int]) -> tuple[float, ...]:
        """A window group's layers' k scales then v scales (disk files, handshake); () unquantized."""
        if not self.quantized:
            return ()
        return tuple(self.k_scales[i] for i in layers) + tuple(self.v_scales[i] for i in layers if self.v_scales)
