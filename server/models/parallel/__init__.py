"""Tensor parallelism, applied to the plain model from outside (docs/structure.md)."""
