"""The model's steps between GEMMs: one small interface, a plain torch implementation and a fused
Triton one (`server.models.kernels`, CUDA only), chosen outside the model (`ModelRunner`). Both round
where transformers' modules round. `linear` takes a float or an FP8 weight (`Fp8Weight`): the torch
ops dequantize it (the CPU's path), the Triton ops run FP8 GEMMs (fp8/linear.py).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from server.models.fp8.weight import Fp8Weight, dequantized_linear

Weight = torch.Tensor | Fp8Weight  # a linear layer's weight [N, K]


class TorchOps:
    """The interface, in plain torch; `TritonOps` overrides it with fused kernels."""

    def __init__(self, eps: float) -> None:
        self.eps = eps

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float | None = None) -> torch.Tensor:
        """transformers' LlamaRMSNorm of x [..., N]: normalize in float32, cast back, then scale by the weight;
        `eps`: this norm's own (DeepSeek's low-rank norms), else the model's."""
        eps = self.eps if eps is None else eps
        if x.dtype == torch.float32:  # the fused op computes exactly this in float32
            return F.rms_norm(x, weight.shape, weight, eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.to(x.dtype)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """residual += x (in place, [R, N]); returns rms_norm(residual)."""
        residual += x
        return self.rms_norm(residual, weight)

    def qk_norm(self, qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, heads: int,
                kv_heads: int) -> torch.Tensor:
        """qkv [T, heads + 2 kv_heads, D] with each q head and k head RMS-normalised (Qwen3, GLM-4.5)."""
        q, k, v = qkv.split([heads, kv_heads, kv_heads], 1)
        return torch.cat((self.rms_norm(q, q_weight), self.rms_norm(k, k_weight), v), 1)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [T, 2I] -> silu(gate) * up [T, I]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def latent_rope(self, q: torch.Tensor, kv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    interleave: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """MLA's rotary: q [T, heads, nope + P], kv [T, R + P] (c, then k_pe), cos and the signed sin [T, P]
        -> (q_pe [T, heads, P], k_pe [T, P]) rotated (`interleave`: DeepSeek's even/odd pairs)."""
        from server.models.rope import apply_interleaved, apply_rotary  # (rope imports the model spec)

        rope = cos.shape[-1]
        rotate = apply_interleaved if interleave else apply_rotary
        return rotate(q[..., -rope:], cos, sin), rotate(kv[:, None, -rope:], cos, sin)[:, 0]

    def linear(self, x: torch.Tensor, weight: Weight, bias: torch.Tensor | None) -> torch.Tensor:
        """F.linear: x [T, K] @ weight [N, K].T (+ bias) -> [T, N]."""
        if isinstance(weight, Fp8Weight):
            return dequantized_linear(x, weight, bias)
        return F.linear(x, weight, bias)


class TritonOps(TorchOps):
    """Fused kernels for 2-D rows with unit column stride (Qwen3's per-head q/k norms and MLA's rotary:
    in place over their heads); other layouts take the torch path."""

    def __init__(self, eps: float) -> None:
        super().__init__(eps)
        from server.models.fp8.linear import Fp8Linears
        from server.models.kernels import elementwise
        from server.models.kernels.gemv import SkinnyLinear

        self._k = elementwise
        self.skinny = SkinnyLinear()  # decode at small batch: per weight shape, whichever `choose` timed faster
        self.fp8 = Fp8Linears()  # FP8 weights: per weight shape and row count, whichever `choose` timed faster

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float | None = None) -> torch.Tensor:
        if x.dim() != 2 or x.stride(1) != 1:
            return super().rms_norm(x, weight, eps)
        return self._k.rms_norm(x, weight, self.eps if eps is None else eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self._k.rms_norm(x, weight, self.eps, residual)

    def qk_norm(self, qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, heads: int,
                kv_heads: int) -> torch.Tensor:
        """In place, one kernel (on the torch path: two norms of about seven small kernels each, and a cat)."""
        if qkv.stride(2) != 1 or qkv.stride(1) != qkv.shape[2]:
            return super().qk_norm(qkv, q_weight, k_weight, heads, kv_heads)
        self._k.qk_norm(qkv, q_weight, k_weight, heads, kv_heads, self.eps)
        return qkv

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._k.silu_mul(gate_up)

    def latent_rope(self, q: torch.Tensor, kv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    interleave: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """In place, one kernel (kernels/latent.py `latent_rope`); returns the rotated views."""
        rope = cos.shape[-1]
        if q.stride(-1) != 1 or kv.stride(-1) != 1 or rope < 4 or rope & (rope - 1) or sin.stride() != cos.stride():
            return super().latent_rope(q, kv, cos, sin, interleave)
        from server.models.kernels.latent import latent_rope

        latent_rope(q, kv, cos, sin, interleave)
        return q[..., -rope:], kv[:, -rope:]

    def linear(self, x: torch.Tensor, weight: Weight, bias: torch.Tensor | None) -> torch.Tensor:
        if isinstance(weight, Fp8Weight):
            return self.fp8.linear(x, weight, bias)
        return self.skinny.linear(x, weight, bias)

    def choose_linear(self, weights: list[Weight], biases: list[torch.Tensor | None], dtype: torch.dtype) -> None:
        """Time our GEMM kernels against cuBLAS for one weight shape (every layer's weight of it), on CUDA:
        the skinny GEMM for float weights (PDSERVE_SKINNY_GEMV=0: cuBLAS), the FP8 paths for FP8 ones."""
        if isinstance(weights[0], Fp8Weight):
            self.fp8.choose(weights, biases, dtype)
        elif os.environ.get("PDSERVE_SKINNY_GEMV", "1") != "0":
            self.skinny.choose(weights, biases)

    def chosen_linears(self) -> dict[str, object]:
        return {**{f"{n}x{k}": c for (n, k), c in self.skinny.chosen.items()}, **self.fp8.summary()}
