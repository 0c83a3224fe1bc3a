"""How many compiled variants each of the project's Triton kernels holds (per device), read from
Triton's own kernel caches. The start-up warm-up logs it, and tests/gpu checks that serving steps of
any shape after the warm-up compile nothing new."""

from __future__ import annotations

from server.models.kernels import attention, elementwise, fp8, latent, moe, route

KERNELS = {"decode_split": attention._decode_split, "decode_merge": attention._decode_merge,
           "prefill": attention._prefill, "rms_norm": elementwise._rms_norm,
           "silu_mul": elementwise._silu_mul, "rope_write": elementwise._rope_write,
           "fp8_quantize": fp8._quantize_rows, "fp8_gemm": fp8._fp8_gemm, "fp8_scale": fp8._scale_out,
           "moe_gate_up": moe._gate_up_silu, "moe_down": moe._down_weighted, "moe_align": moe._align,
           "moe_route": route._route, "latent_rope": latent._latent_rope, "qk_norm": elementwise._head_rms_norm,
           "fp8_gemv": fp8._fp8_gemv}


def compiled_variants() -> dict[str, int]:
    """Kernel name -> compiled variants over all devices (0 under TRITON_INTERPRET: it compiles nothing)."""
    return {name: _count(fn) for name, fn in KERNELS.items()}


def _count(fn: object) -> int:
    caches = getattr(fn, "device_caches", None)  # Triton >= 3.2: device -> (kernel cache, ...)
    if caches is not None:
        return sum(len(entry[0]) for entry in caches.values())
    legacy = getattr(fn, "cache", None)  # older Triton: device -> kernel cache
    return sum(len(c) for c in legacy.values()) if isinstance(legacy, dict) else 0
