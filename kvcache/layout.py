"""`CacheLayout`: what a model needs cached: per-layer windows, the device, and the `KVFormat` of
its blocks (kvcache/kv_format.py); and the FP8 rounding both attention paths use."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvcache.kv_format import FP8, KVFormat, dtype_name, positive_int  # noqa: F401 (re-exported)
from kvcache.kv_scales import FP8_MAX, as_float32, checked_scales


def quantize_fp8(x: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """x * inverse (float32; `inverse` broadcasts: 1 / scale) as e4m3, saturated at +-FP8_MAX and
    rounded to nearest even: what an FP8 cache stores (the Triton kernels' `e4m3_bits` bit for bit)."""
    return (x.float() * inverse).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def inverse_scale(scale: float) -> float:
    """1 / scale as the float32 both attention paths multiply by before rounding to FP8."""
    return as_float32(1.0 / scale)


@dataclass(frozen=True)
class CacheLayout:
    """Per-layer windows (full attention: `max_seq_len`) and the KV format (FP8 without scales: 1.0)."""

    layer_windows: tuple[int, ...]  # per layer attention window in tokens
    format: KVFormat
    device: torch.device | str
    max_seq_len: int

    def __post_init__(self) -> None:
        positive_int("CacheLayout.max_seq_len", self.max_seq_len)
        if not isinstance(self.format, KVFormat):
            raise ValueError(f"CacheLayout.format={self.format!r}: must be a KVFormat")
        try:
            device = torch.device(self.device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"CacheLayout.device={self.device!r}: {exc}") from None
        object.__setattr__(self, "device", device)
        object.__setattr__(self, "layer_windows", tuple(self.layer_windows))
        if not self.layer_windows:
            raise ValueError("CacheLayout.layer_windows=(): needs at least one layer")
        for i, w in enumerate(self.layer_windows):
            if isinstance(w, bool) or not isinstance(w, int) or not 0 < w <= self.max_seq_len:
                raise ValueError(f"CacheLayout.layer_windows[{i}]={w!r}: layer {i}'s window must be an "
                                 f"integer in [1, max_seq_len={self.max_seq_len}]")
        self._check_scales()

    def _check_scales(self) -> None:
        f = self.format
        if not f.quantized:
            return
        names = ("k_scales",) if f.latent else ("k_scales", "v_scales")
        values = {n: getattr(f, n) or (1.0,) * self.num_layers for n in names}
        for name, v in values.items():
            checked_scales(f"CacheLayout.format.{name}", v, self.num_layers)
        object.__setattr__(self, "format", dataclasses.replace(f, **values))

    @property
    def num_layers(self) -> int:
        return len(self.layer_windows)

    def bytes_per_token(self, num_layers: int | None = None) -> int:
        return self.format.bytes_per_token(self.num_layers if num_layers is None else num_layers)
