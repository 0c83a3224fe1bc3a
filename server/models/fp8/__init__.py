"""FP8 (e4m3) weights: loading FP8 checkpoints, quantizing float ones at load, and the FP8 linear.
The model stays plain: `ops.linear` takes either kind of weight (docs/FP8.md).
"""
