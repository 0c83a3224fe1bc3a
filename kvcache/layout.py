"""`CacheLayout`: what a model needs cached (per-layer windows, KV heads, head size, dtype, device)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class CacheLayout:
    """What the model needs cached. A full-attention layer's window is `max_seq_len`."""

    layer_windows: tuple[int, ...]  # per layer attention window in tokens
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device | str
    max_seq_len: int

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

    @property
    def num_layers(self) -> int:
        return len(self.layer_windows)

    @property
    def element_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def bytes_per_token(self, num_layers: int | None = None) -> int:
        """K and V bytes of one token over `num_layers` layers (default: all layers)."""
        layers = self.num_layers if num_layers is None else num_layers
        return layers * 2 * self.num_kv_heads * self.head_dim * self.element_bytes
