"""The FP8 linear on the GPU: activations quantized per token (kernels/fp8.py `quantize_rows`), then the
GEMM the warm-up timed fastest for the weight's shape and the step's row count (`run`): cuBLAS with
unit scales and our scale epilogue (its per-tensor FP8 path read an 8B model's linears 1.68x faster
than bf16 at M=1 on the H200), cuBLAS row-wise with the bias fused (one kernel, but measured reading
the weight at half rate at M=1), a Triton config for rows <= 64 (at up to 16 rows also configs that
quantize inside the GEMM), at one row a weight-only GEMV (kernels/fp8.py `fp8_gemv`: x is not quantized,
so its reference is the dequantized product), the float32 torch reference, and for a block-scaled weight
its own kernel (kernels/fp8_blocks.py) or the dequantized product.

`choose` checks each path against the torch reference (a kernel that computes wrong on some GPU is
skipped) and keeps a Triton config only if it beats cuBLAS by 2%; PDSERVE_SKINNY_GEMV=0 keeps cuBLAS.
Before any choice and past LONG_ROWS rows: `default_path`. Nothing here syncs the host or allocates
outside torch's allocator, so CUDA graphs capture it.
"""

from __future__ import annotations

import logging
import os

import torch

from server.models.fp8.weight import Fp8Weight, dequantized_linear, w8a8_linear
from server.models.kernels.fp8 import Config, GemvConfig, block_m, fp8_gemm, fp8_gemv, quantize_rows, scale_out
from server.models.kernels.fp8_blocks import block_fp8_gemm
from server.models.kernels.gemv import cuda_ms, relative_error

log = logging.getLogger(__name__)

CUBLAS_UNIT, CUBLAS_ROWWISE, TORCH = "cublas_unit", "cublas_rowwise", "torch"
BLOCKS, DEQUANT = "fp8_blocks", "dequantized"  # a block-scaled weight's two paths
ROW_CLASSES = (1, 8, 16, 32, 64)  # a step of m rows takes the choice of the first class >= m
PREFILL_ROWS = 256  # longer steps take the choice timed at this many rows (cuBLAS only)
LONG_ROWS = 1024  # past this, a bf16 model's GEMM is compute-bound: cuBLAS row-wise, no float32 [M, N] buffer
# by row tile (kernels.fp8.block_m); the first is the default. (BLOCK_N, BLOCK_K, warps, stages, swap,
# quant: the GEMM quantizes its rows itself, one kernel per linear; worth it at decode's few rows)
CONFIGS: dict[int, list[Config]] = {
    16: [(32, 256, 4, 4, False, True), (64, 256, 4, 4, False, True), (16, 512, 4, 4, False, True),
         (128, 256, 4, 3, True, True), (32, 256, 4, 4, False, False), (64, 512, 8, 3, False, False)],
    32: [(64, 128, 4, 4, False, False), (64, 256, 4, 3, True, False), (128, 128, 4, 3, True, False)],
    64: [(64, 128, 4, 4, False, False), (128, 128, 4, 3, False, False), (128, 128, 8, 3, True, False)],
}
GEMV_CONFIGS = [GemvConfig(8, 512, 4), GemvConfig(16, 512, 4), GemvConfig(8, 1024, 4), GemvConfig(16, 1024, 8),
                GemvConfig(8, 2048, 8), GemvConfig(32, 256, 4)]  # timed at one row only
CHECK_ROWS = 256  # output features the correctness check compares
CHECK_TOLERANCE = 2e-2  # max |out - reference| / max |reference| (bf16 output rounds at 2^-8)
Path = str | Config | GemvConfig


def row_class(m: int) -> int:
    return next((c for c in ROW_CLASSES if m <= c), PREFILL_ROWS)


def cublas_fits(n: int, k: int) -> bool:
    """torch._scaled_mm wants K and N multiples of 16 (M is free)."""
    return n % 16 == 0 and k % 16 == 0


class Fp8Linears:
    """`linear(x, w, b)` for `Fp8Weight`s; `chosen[(N, K, row class)]` is the GEMM path after `choose`."""

    def __init__(self) -> None:
        self.chosen: dict[tuple[int, int, int], Path] = {}
        self.timings: dict[tuple[int, int, int], dict[str, float]] = {}  # what `choose` measured, in ms
        self._ones: dict[torch.device, torch.Tensor] = {}

    def linear(self, x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None) -> torch.Tensor:
        if x.stride(-1) != 1:
            x = x.contiguous()
        n, k = w.shape
        path = None if x.shape[0] > LONG_ROWS else self.chosen.get((n, k, row_class(x.shape[0])))
        return self.run(default_path(x, w) if path is None else path, x, w, bias)

    def run(self, path: Path, x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None) -> torch.Tensor:
        """x [M, K] (unit column stride) in the model dtype -> [M, N] in the same dtype."""
        if path == TORCH:
            return w8a8_linear(x, w, bias)
        if path == BLOCKS:
            return block_fp8_gemm(x, w.qweight, w.scale, w.block_k, bias)
        if path == DEQUANT:
            return dequantized_linear(x, w, bias)
        if isinstance(path, GemvConfig):
            return fp8_gemv(x, w.qweight, w.scale, bias, path)
        if isinstance(path, tuple) and path[-1]:  # the GEMM quantizes x itself
            return fp8_gemm(x, None, w.qweight, w.scale, bias, x.dtype, path, w.input_scale)
        xq, xs = quantize_rows(x, w.input_scale)
        if path == CUBLAS_UNIT:
            one = self._one(x.device)
            acc = torch._scaled_mm(xq, w.qweight.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
            return scale_out(acc, xs, w.scale, bias, x.dtype)
        if path == CUBLAS_ROWWISE:
            m, n = x.shape[0], w.shape[0]
            return torch._scaled_mm(xq, w.qweight.t(), scale_a=xs.view(m, 1), scale_b=w.scale.view(1, n),
                                    bias=bias, out_dtype=x.dtype)
        return fp8_gemm(xq, xs, w.qweight, w.scale, bias, x.dtype, path)

    def _one(self, device: torch.device) -> torch.Tensor:
        if device not in self._ones:  # made at warm-up, before any graph capture
            self._ones[device] = torch.ones((), dtype=torch.float32, device=device)
        return self._ones[device]

    def choose(self, weights: list[Fp8Weight], biases: list[torch.Tensor | None], dtype: torch.dtype) -> None:
        """Time every path for one weight shape (every layer's weight of it) per row class (CUDA only)."""
        n, k = weights[0].shape
        if weights[0].device.type != "cuda" or (n, k, ROW_CLASSES[0]) in self.chosen:
            return
        ours = os.environ.get("PDSERVE_SKINNY_GEMV", "1") != "0"
        for rows in (*ROW_CLASSES, PREFILL_ROWS):
            x = torch.randn(rows, k, dtype=dtype, device=weights[0].device)
            paths = [BLOCKS, DEQUANT] if weights[0].block_k else candidates(rows, n, k, dtype, ours)
            timings = {_name(p): ms for p in paths if (ms := self._try(p, x, weights, biases)) is not None}
            self.timings[(n, k, rows)] = timings
            self.chosen[(n, k, rows)] = _fastest(paths, timings)

    def _try(self, path: Path, x: torch.Tensor, weights: list[Fp8Weight],
             biases: list[torch.Tensor | None]) -> float | None:
        """The time of `path` over every weight in ms, or None if it fails or computes wrong here."""
        try:
            error = self._error(path, x, weights[0], biases[0])
            if error > CHECK_TOLERANCE:
                log.warning("FP8 GEMM %s on %s at %d rows is off by %.3g of the reference: not used",
                            _name(path), tuple(weights[0].shape), x.shape[0], error)
                return None
            pairs = list(zip(weights, biases, strict=True))
            return cuda_ms(lambda: self._sweep(path, x, pairs))
        except Exception as exc:  # noqa: BLE001 (a config this GPU cannot compile or run is skipped, not fatal)
            log.warning("FP8 GEMM %s on %s at %d rows failed here: %s", _name(path), tuple(weights[0].shape),
                        x.shape[0], exc)
            return None

    def _sweep(self, path: Path, x: torch.Tensor, pairs: list[tuple[Fp8Weight, torch.Tensor | None]]) -> None:
        for w, b in pairs:  # each output freed before the next: the pool is already allocated
            self.run(path, x, w, b)

    def _error(self, path: Path, x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None) -> float:
        rows = min(CHECK_ROWS, w.shape[0])
        part = Fp8Weight(w.qweight[:rows], w.scale[:rows], w.input_scale, w.block_k)
        weight_only = w.block_k or isinstance(path, GemvConfig) or path == DEQUANT  # these do not quantize x
        reference = dequantized_linear if weight_only else w8a8_linear
        ref = reference(x, part, None if bias is None else bias[:rows])
        return relative_error(self.run(path, x, w, bias)[:, :rows], ref)

    def summary(self) -> dict[str, str]:
        """"NxK@rows" -> the chosen path's name, for the start-up log."""
        return {f"{n}x{k}@{rows}": _name(p) for (n, k, rows), p in sorted(self.chosen.items())}


def default_path(x: torch.Tensor, w: Fp8Weight) -> Path:
    """Before any choice, and for steps past LONG_ROWS: a block-scaled weight's own GEMM; else cuBLAS
    (row-wise for bf16 prefill-sized steps: one kernel and no float32 intermediate), else our kernel,
    else the torch reference."""
    n, k = w.shape
    if w.block_k:
        return BLOCKS
    if x.device.type == "cuda" and cublas_fits(n, k):
        return CUBLAS_ROWWISE if x.shape[0] > ROW_CLASSES[-1] and x.dtype == torch.bfloat16 else CUBLAS_UNIT
    if x.shape[0] <= ROW_CLASSES[-1] or x.device.type != "cuda":
        return CONFIGS[16][0]  # any row count runs (in row tiles); under the CPU interpreter, tests
    return TORCH


def candidates(rows: int, n: int, k: int, dtype: torch.dtype, ours: bool = True) -> list[Path]:
    paths: list[Path] = []
    if cublas_fits(n, k):
        paths += [CUBLAS_UNIT] + ([CUBLAS_ROWWISE] if dtype == torch.bfloat16 else [])
    if ours and rows <= ROW_CLASSES[-1]:
        paths += CONFIGS[block_m(rows)] + (GEMV_CONFIGS if rows == 1 else [])
    return paths or [CONFIGS[64][0] if rows <= ROW_CLASSES[-1] else TORCH]


def _fastest(paths: list[Path], timings: dict[str, float]) -> Path:
    """The fastest path that ran; a Triton config only if it beats the best cuBLAS path by 2%."""
    cublas = [p for p in paths if isinstance(p, str) and _name(p) in timings]
    ours = [p for p in paths if not isinstance(p, str) and _name(p) in timings]
    best = min(cublas, key=lambda p: timings[_name(p)], default=None)
    fast = min(ours, key=lambda p: timings[_name(p)], default=None)
    if fast is not None and (best is None or timings[_name(fast)] < 0.98 * timings[_name(best)]):
        return fast
    return best if best is not None else TORCH


def _name(path: Path) -> str:
    if isinstance(path, str):
        return path
    if isinstance(path, GemvConfig):
        return f"gemv_{path.block_n}x{path.block_k}_w{path.warps}"
    block_n, block_k, warps, stages, swap, quant = path
    return f"triton_{block_n}x{block_k}_w{warps}_s{stages}" + ("_swap" if swap else "") + ("_quant" if quant else "")
