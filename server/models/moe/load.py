"""Tokens routed to each expert of each MoE layer since the server started, for /metrics.

Each `MoEBlock` counts its tokens into a device tensor inside the forward (captured in the graphs).
`ExpertLoad.read` never waits for the device: on CUDA it starts a non-blocking copy of them all into
pinned memory at most every `interval_s` and takes its numbers on a later read, once its event has
passed (until then, the last numbers); on the CPU it reads them at once. Counts start after the
warm-up (`reset`).
"""

from __future__ import annotations

import time

import torch

from server.models.moe.block import MoEBlock


class ExpertLoad:
    def __init__(self, blocks: dict[int, MoEBlock], interval_s: float = 1.0) -> None:
        self.blocks = blocks  # layer -> its block
        self.interval_s = interval_s
        self._started = 0.0
        self.reset()

    def reset(self) -> None:
        """Counts start from 0 (after the warm-up's steps)."""
        for block in self.blocks.values():
            block.load.zero_()
        self._totals: dict[int, list[int]] = {layer: [0] * b.spec.num_experts for layer, b in self.blocks.items()}
        self._pending: tuple[torch.Tensor, torch.cuda.Event] | None = None

    def read(self) -> dict[int, list[int]]:
        """layer -> tokens routed to each of its experts (cumulative), as of the last copy that landed."""
        if not self.blocks:
            return {}
        loads = [b.load for b in self.blocks.values()]
        if loads[0].device.type != "cuda":
            self._totals = dict(zip(self.blocks, torch.stack(loads).tolist(), strict=True))
            return self._totals
        if self._pending is not None and self._pending[1].query():
            self._totals = dict(zip(self.blocks, self._pending[0].tolist(), strict=True))
            self._pending = None
        now = time.monotonic()
        if self._pending is None and now - self._started >= self.interval_s:
            host = torch.empty((len(loads), loads[0].numel()), dtype=torch.int64, pin_memory=True)
            host.copy_(torch.stack(loads), non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._pending, self._started = (host, event), now
        return self._totals
