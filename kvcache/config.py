"""Configuration of the KV cache: `KvCacheConfig` (TensorRT-LLM's kv_cache_config field names, so the
YAML reads the same) and `CacheLayout` (what the model needs cached)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import torch

DEFAULT_GPU_FRACTION = 0.9  # TensorRT-LLM's default free_gpu_memory_fraction


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _field_problem(name: str, value: object) -> str | None:
    """Why `value` is not valid for KvCacheConfig field `name` (None when it is)."""
    if name in ("enable_block_reuse", "enable_partial_reuse", "copy_on_partial_reuse", "onboard_blocks"):
        return None if isinstance(value, bool) else "must be true or false"
    if name == "tokens_per_block":
        return None if _is_int(value) and value > 0 else "must be an integer > 0"
    if name == "max_tokens":
        return None if value is None or (_is_int(value) and value > 0) else "must be null or an integer > 0"
    if name == "free_gpu_memory_fraction":
        ok = value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 < value <= 1.0)
        return None if ok else "must be null or a number in (0, 1]"
    if name == "host_cache_size":
        return None if _is_int(value) and value >= 0 else "must be an integer >= 0 (bytes)"
    if name == "secondary_offload_min_priority":
        return None if _is_int(value) and 0 <= value <= 100 else "must be an integer in [0, 100]"
    raise AssertionError(name)


@dataclass(frozen=True)
class KvCacheConfig:
    """Paged KV cache settings. Capacities are per window group (VSWA: one group per window size)."""

    tokens_per_block: int = 32
    max_tokens: int | None = None  # primary capacity in tokens; None: from free memory (see manager)
    # share of the free GPU memory (after the weights) for the primary pool, when max_tokens is None
    # on CUDA; None: DEFAULT_GPU_FRACTION, which `pdserve launch` splits between servers on the GPU
    free_gpu_memory_fraction: float | None = None
    enable_block_reuse: bool = True
    enable_partial_reuse: bool = True
    copy_on_partial_reuse: bool = True
    host_cache_size: int = 0  # bytes of the secondary (host) pool; 0 = no offload
    secondary_offload_min_priority: int = 35  # evicted blocks with priority >= this are offloaded
    onboard_blocks: bool = True  # reuse host-cached blocks (onboard them); False: host blocks never match

    def __post_init__(self) -> None:
        _raise_first_problem(dataclasses.asdict(self), "KvCacheConfig")

    @classmethod
    def from_dict(cls, d: Mapping, source: str = "kv_cache_config") -> KvCacheConfig:
        """Build from a YAML mapping. Unknown key or bad value: ValueError naming f"{source}.{key}"."""
        names = [f.name for f in dataclasses.fields(cls)]
        for key, value in d.items():
            if key not in names:
                raise ValueError(f"{source}.{key}={value!r}: unknown key (valid: {', '.join(names)})")
        values = {name: d.get(name, getattr(cls, name)) for name in names}
        _raise_first_problem(values, source)
        return cls(**values)


def _raise_first_problem(values: Mapping[str, object], source: str) -> None:
    """ValueError naming f"{source}.{field}" and the value of the first invalid field, if any."""
    for name, value in values.items():
        why = _field_problem(name, value)
        if why is not None:
            raise ValueError(f"{source}.{name}={value!r}: {why}")
    tpb, max_tokens = values["tokens_per_block"], values["max_tokens"]
    if max_tokens is not None and max_tokens < tpb:
        raise ValueError(f"{source}.max_tokens={max_tokens!r}: below one block (tokens_per_block={tpb})")


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
