"""FP8 (e4m3) weights: loading FP8 checkpoints, quantizing float ones at load, and the FP8 linear.

`weight.py` holds the stored form (`Fp8Weight`) and the plain torch math, `checkpoint.py` reads a
checkpoint's `quantization_config`, `load.py` loads the tensors (`blocks.py`: block-scaled
checkpoints' weights), `experts.py` stacks a MoE layer's FP8 experts (their grouped GPU kernels:
server/models/kernels/moe_fp8.py), `linear.py` runs FP8 linears on the
GPU (Triton kernels in server/models/kernels/fp8.py, cuBLAS `torch._scaled_mm`), chosen per shape at
warm-up. The model stays plain: `ops.linear` takes either kind of weight. docs/FP8.md has the figures.
"""
