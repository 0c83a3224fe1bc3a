"""Small host lists to the device without waiting for the device's queued work."""

from __future__ import annotations

import torch


def upload(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` on `device`, copied from pinned memory with a non-blocking copy (torch keeps the
    pinned buffer until the copy has run); `torch.tensor(values, device=cuda)` would synchronise."""
    host = torch.tensor(values, dtype=dtype)
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host
