"""`CacheLayout`: what a model needs cached (per-layer windows, KV heads, head size, dtype, device),
and for an FP8 cache the per-layer k/v scales its blocks are stored with (kvcache/kv_scales.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcache.kv_scales import FP8_MAX, as_float32, checked_scales, scales_digest

FP8 = torch.float8_e4m3fn  # the quantized KV element type (`kv_cache_config.dtype: fp8`)


def quantize_fp8(x: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """x * inverse (float32; `inverse` broadcasts: 1 / scale) as e4m3, saturated at +-FP8_MAX and
    rounded to nearest even: what an FP8 cache stores (the Triton kernels' `e4m3_bits` bit for bit)."""
    return (x.float() * inverse).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def inverse_scale(scale: float) -> float:
    """1 / scale as the float32 both attention paths multiply by before rounding to FP8."""
    return as_float32(1.0 / scale)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def dtype_name(dtype: torch.dtype) -> str:
    """"float8_e4m3fn", "bfloat16", ...: torch's name without the module."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class CacheLayout:
    """What the model needs cached. A full-attention layer's window is `max_seq_len`. An FP8 cache
    (dtype float8_e4m3fn) has one k and one v scale per layer (default 1.0); any other has none."""

    layer_windows: tuple[int, ...]  # per layer attention window in tokens
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device | str
    max_seq_len: int
    k_scales: tuple[float, ...] = ()  # FP8: per layer, K is stored as K / k_scale (float32 values)
    v_scales: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        for name in ("num_kv_heads", "head_dim", "max_seq_len"):
            value = getattr(self, name)
            if not _is_int(value) or value <= 0:
                raise ValueError(f"CacheLayout.{name}={value!r}: must be an integer > 0")
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"CacheLayout.dtype={self.dtype!r}: must be a torch.dtype")
        try:
            device = torch.device(self.device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"CacheLayout.device={self.device!r}: {exc}") from None
        object.__setattr__(self, "device", device)
        object.__setattr__(self, "layer_windows", tuple(self.layer_windows))
        if not self.layer_windows:
            raise ValueError("CacheLayout.layer_windows=(): needs at least one layer")
        for i, w in enumerate(self.layer_windows):
            if not _is_int(w) or not 0 < w <= self.max_seq_len:
                raise ValueError(f"CacheLayout.layer_windows[{i}]={w!r}: layer {i}'s window must be an "
                                 f"integer in [1, max_seq_len={self.max_seq_len}]")
        self._set_scales()

    def _set_scales(self) -> None:
        if not self.quantized:
            if self.k_scales or self.v_scales:
                raise ValueError(f"CacheLayout: k/v scales are for an FP8 cache, not {dtype_name(self.dtype)}")
            return
        for name in ("k_scales", "v_scales"):
            values = getattr(self, name) or (1.0,) * self.num_layers
            object.__setattr__(self, name, checked_scales(f"CacheLayout.{name}", values, self.num_layers))

    @property
    def num_layers(self) -> int:
        return len(self.layer_windows)

    @property
    def quantized(self) -> bool:
        """An FP8 cache: blocks hold e4m3 values with per-layer scales."""
        return self.dtype == FP8

    @property
    def element_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def kv_format(self) -> str:
        """What a block's bytes mean beyond the model: "" for the model's own dtype, else the FP8
        dtype and a digest of the scales (a block hash namespace: kvcache.hashing.kv_format_salt)."""
        if not self.quantized:
            return ""
        return f"{dtype_name(self.dtype)}:{scales_digest(self.k_scales, self.v_scales)}"

    def layer_scales(self, layer: int) -> tuple[float, float]:
        """(k scale, v scale) of one layer; (1.0, 1.0) for a cache in the model's dtype."""
        return (self.k_scales[layer], self.v_scales[layer]) if self.quantized else (1.0, 1.0)

    def group_scales(self, layers: tuple[int, ...] | list[int]) -> tuple[float, ...]:
        """The k scales then the v scales of `layers` (a window group's): what its blocks' bytes
        were stored with; () for a cache in the model's dtype."""
        if not self.quantized:
            return ()
        return tuple(self.k_scales[i] for i in layers) + tuple(self.v_scales[i] for i in layers)

    def bytes_per_token(self, num_layers: int | None = None) -> int:
        """K and V bytes of one token over `num_layers` layers (default: all layers)."""
        layers = self.num_layers if num_layers is None else num_layers
        return layers * 2 * self.num_kv_heads * self.head_dim * self.element_bytes
