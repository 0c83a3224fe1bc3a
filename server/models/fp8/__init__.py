"""FP8 (e4m3) weights: loading FP8 checkpoints, quantizing float ones at load, and the FP8 linear.

`weight.py`: the stored form (`Fp8Weight`) and the torch math; `checkpoint.py`: a checkpoint's
`quantization_config`; `load.py` (and `blocks.py`, block-scaled checkpoints): the tensors;
`experts.py`: a MoE layer's stacked experts; `linear.py`: the GPU's FP8 linears, chosen per shape
at warm-up. The model stays plain: `ops.linear` takes either kind of weight (docs/FP8.md).
"""
