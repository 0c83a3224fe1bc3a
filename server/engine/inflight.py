"""A launched step's sampled token ids on their way to the host (async scheduling).

`SampledStep` starts one non-blocking device->host copy of the step's sampled ids into a pinned
buffer and records an event behind it; `tokens()` waits for that event: the step's one host
synchronisation. The ids also stay on the device (`picked`): the next step, launched before this
one is waited for, takes each request's pending token from there (`runner.PendingTokens`).

On the CPU the forward is synchronous, so the ids are on the host when the step returns; the same
code runs, with no copy and no event.
"""

from __future__ import annotations

import torch

from server.engine.request import Request

DEPTH = 2  # steps whose ids can be unread at once: the one being processed and the one just launched


class TokenStaging:
    """Pinned host buffers for the sampled ids, used in turn. A buffer comes back after DEPTH sampled
    steps, and by then the step that used it has been waited for (`EngineCore.step` processes a step
    before it launches the second one after it)."""

    def __init__(self, device: torch.device, max_batch_size: int) -> None:
        self._buffers = [torch.empty(max_batch_size, dtype=torch.int64, pin_memory=True)
                         for _ in range(DEPTH)] if device.type == "cuda" else []
        self._turn = 0

    def take(self) -> torch.Tensor | None:
        """The next buffer; None on the CPU (the ids are on the host already)."""
        if not self._buffers:
            return None
        self._turn = (self._turn + 1) % DEPTH
        return self._buffers[self._turn]


class SampledStep:
    """One launched step's sampled tokens: row i of `picked` belongs to `requests[i]`."""

    def __init__(self, requests: list[Request], picked: torch.Tensor, staging: torch.Tensor | None,
                 drafts: list[tuple[int, ...]] | None = None) -> None:
        self.requests = requests
        self.picked = picked  # [len(requests)] int64 on the device; read by the next step's inputs
        self.rows = {request: row for row, request in enumerate(requests)}
        self.hands_over = any(r.is_context_only for r in requests)  # a context leg's first token
        # speculative decoding: requests[i]'s drafts, its rows 1 + len(drafts[i]) consecutive ones of
        # `picked` (a verify step is postprocessed before the next schedule: `rows` is not read)
        self.drafts = drafts
        self._event: torch.cuda.Event | None = None
        self._host = picked
        if staging is not None and drafts is None:
            self._host = staging[: len(requests)]
            self._host.copy_(picked, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()

    def tokens(self) -> list[int]:
        """The sampled ids on the host, waiting for the step (and its copy) to end."""
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()

    def runs(self) -> list[list[int]]:
        """Per request its sampled ids: one, or 1 + its drafts of a verify step."""
        tokens = self.tokens()
        if self.drafts is None:
            return [[t] for t in tokens]
        runs, at = [], 0
        for drafts in self.drafts:
            runs.append(tokens[at:at + 1 + len(drafts)])
            at += 1 + len(drafts)
        return runs
