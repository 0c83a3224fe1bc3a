"""The FP8 KV cache's numbers: the e4m3 range, per-layer k/v scales, and the scales file that
`pdserve calibrate-kv` writes and `kv_cache_config.scales` names. No torch (the deployment checks in
server/config/schema.py compare scales before anything is loaded).

K is stored as e4m3(K / k_scale), saturated at +-FP8_MAX (V likewise); a scale is the largest |K|
expected over FP8_MAX, rounded to float32 once, here (the kernels use float32). The scales file:

    {"format": "pdserve-kv-scales", "version": 1, "dtype": "float8_e4m3fn",
     "k_scale": [one per layer], "v_scale": [one per layer], "model": "...", "tokens": 4096}
"""

from __future__ import annotations

import math
import struct
from hashlib import blake2b
from pathlib import Path

import msgspec

FP8_DTYPE = "float8_e4m3fn"  # torch's name of the one FP8 format the cache stores (e4m3, finite)
FP8_MAX = 448.0  # the largest finite e4m3fn value
SCALES_FORMAT = "pdserve-kv-scales"
SCALES_VERSION = 1


class ScalesFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    format: str
    version: int
    dtype: str
    k_scale: list[float]
    v_scale: list[float]
    model: str = ""  # the model the sample ran on (information only)
    tokens: int = 0  # tokens of sample text behind the scales (0: not calibrated here)


def as_float32(value: float) -> float:
    return struct.unpack("<f", struct.pack("<f", value))[0]


def checked_scales(name: str, values: list[float] | tuple[float, ...], num_layers: int) -> tuple[float, ...]:
    """One scale per layer, each finite and > 0, rounded to float32; ValueError naming `name`."""
    if len(values) != num_layers:
        raise ValueError(f"{name}: {len(values)} values for {num_layers} layers")
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"{name}[{i}]={v!r}: a scale must be a finite number > 0")
        scale = as_float32(float(v))
        if scale <= 0 or not math.isfinite(scale):
            raise ValueError(f"{name}[{i}]={v!r}: outside float32's range")
        out.append(scale)
    return tuple(out)


def scales_digest(k_scales: tuple[float, ...], v_scales: tuple[float, ...]) -> str:
    """A short hex digest of the scales (their float32 bytes): equal scales, equal digest."""
    packed = struct.pack(f"<{len(k_scales) + len(v_scales)}f", *k_scales, *v_scales)
    return blake2b(packed, digest_size=8).hexdigest()


def read_scales(path: str | Path, num_layers: int | None = None) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(k scales, v scales) of a scales file (for `num_layers` layers); ValueError naming the file."""
    where = f"kv_cache_config.scales={str(path)!r}"
    try:
        data = Path(path).expanduser().read_bytes()
    except OSError as exc:
        raise ValueError(f"{where}: cannot read it: {exc.strerror or exc}") from None
    try:
        f = msgspec.json.decode(data, type=ScalesFile)
    except msgspec.DecodeError as exc:
        raise ValueError(f"{where}: not a scales file ({exc})") from None
    if (f.format, f.version, f.dtype) != (SCALES_FORMAT, SCALES_VERSION, FP8_DTYPE):
        raise ValueError(f"{where}: format {f.format!r} version {f.version} dtype {f.dtype!r}; expected "
                         f"{SCALES_FORMAT!r} version {SCALES_VERSION} dtype {FP8_DTYPE!r}")
    if len(f.k_scale) != len(f.v_scale):
        raise ValueError(f"{where}: {len(f.k_scale)} k_scale values but {len(f.v_scale)} v_scale values")
    layers = len(f.k_scale) if num_layers is None else num_layers
    try:
        return checked_scales("k_scale", f.k_scale, layers), checked_scales("v_scale", f.v_scale, layers)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def write_scales(path: str | Path, k_scales: list[float], v_scales: list[float], *, model: str = "",
                 tokens: int = 0) -> None:
    """Write a scales file (the values rounded to float32, as they will be read)."""
    layers = len(k_scales)
    body = ScalesFile(SCALES_FORMAT, SCALES_VERSION, FP8_DTYPE, list(checked_scales("k_scale", k_scales, layers)),
                      list(checked_scales("v_scale", v_scales, layers)), model, tokens)
    Path(path).write_bytes(msgspec.json.format(msgspec.json.encode(body)) + b"\n")
