"""Block-scaled FP8 checkpoints (`quant_method: fp8`, `weight_block_size: [128, 128]`, as DeepSeek-V3
and Qwen3-FP8 ship): each float8 weight [N, K] has a float32 `*.weight_scale_inv` [ceil(N / 128),
ceil(K / 128)], a multiplier despite its name. `from_block_checkpoint` expands the row blocks to their
rows (exact), so such weights fuse and stack row by row as per-channel ones do. The CPU runs them
dequantized; the GPU runs kernels/fp8_blocks.py (linears) and kernels/moe.py (experts), which read
the float8 weight once and scale each 128-column block's partial sum.
"""

from __future__ import annotations

import torch

from server.models.fp8.weight import Fp8Weight, check_matrix


def from_block_checkpoint(qweight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], name: str) -> Fp8Weight:
    """A checkpoint's float8 weight [N, K] and its block scales [ceil(N / rows), ceil(K / columns)]; a
    ValueError naming `name` for any other shape."""
    check_matrix(qweight, name)
    (n, k), (bn, bk) = qweight.shape, block
    want = (-(-n // bn), -(-k // bk))
    if tuple(scale.shape) != want:
        raise ValueError(f"weight {name!r}: a block scale of shape {tuple(scale.shape)} for a weight of shape "
                         f"{(n, k)} in blocks of {list(block)}: want {want}")
    rows = scale.float().repeat_interleave(bn, dim=0)[:n].contiguous()
    return Fp8Weight(qweight.contiguous(), rows, None, bk)
