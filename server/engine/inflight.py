"""A launched step's sampled token ids on their way to the host (async scheduling).

`SampledStep` starts one non-blocking device->host copy of the step's sampled ids (and of its
log-probabilities, packed as int64 behind them by server/engine/logprobs.py) into a pinned buffer,
with an event behind it; `tokens()` waits for that event: the step's one host synchronisation. The
ids also stay on the device (`picked`): the next step, launched before this one is waited for, takes
each pending token from there (`runner.PendingTokens`). On the CPU the forward is synchronous: the
same code runs, with no copy and no event.
"""

from __future__ import annotations

import torch

from server.engine import logprobs as lp
from server.engine.request import Request
from server.types import TokenLogprob

DEPTH = 2  # steps whose ids can be unread at once: the one being processed and the one just launched


class TokenStaging:
    """Pinned host buffers for the sampled ids (and logprobs), used in turn. A buffer comes back after
    DEPTH sampled steps, and by then the step that used it has been waited for (`EngineCore.step`
    processes a step before it launches the second one after it)."""

    def __init__(self, device: torch.device, max_batch_size: int) -> None:
        self._buffers = [torch.empty(max_batch_size, dtype=torch.int64, pin_memory=True)
                         for _ in range(DEPTH)] if device.type == "cuda" else []
        self._turn = 0

    def take(self, size: int) -> torch.Tensor | None:
        """The next buffer, of at least `size` int64 (a larger one replaces it when it is smaller:
        a step still reading the old one keeps it alive); None on the CPU (the ids are on the host)."""
        if not self._buffers:
            return None
        self._turn = (self._turn + 1) % DEPTH
        if self._buffers[self._turn].numel() < size:
            grown = max(size, 2 * self._buffers[self._turn].numel())
            self._buffers[self._turn] = torch.empty(grown, dtype=torch.int64, pin_memory=True)
        return self._buffers[self._turn]


class SampledStep:
    """One launched step's sampled tokens: row i of `picked` belongs to `requests[i]`; and its
    logprobs (`logprobs`: the packed values and their plan, from `logprobs.launch`). A step of prompt
    rows only (a prompt logprobs chunk that samples nothing) has no request and no `picked`."""

    def __init__(self, requests: list[Request], picked: torch.Tensor | None, staging: TokenStaging,
                 drafts: list[tuple[int, ...]] | None = None,
                 logprobs: tuple[torch.Tensor, lp.LogprobPlan] | None = None) -> None:
        self.requests = requests
        self.picked = picked  # [len(requests)] int64 on the device; read by the next step's inputs
        self.rows = {request: row for row, request in enumerate(requests)}
        self.hands_over = any(r.is_context_only for r in requests)  # a context leg's first token
        # speculative decoding: requests[i]'s drafts, its rows 1 + len(drafts[i]) consecutive ones of
        # `picked` (a verify step is postprocessed before the next schedule: `rows` is not read)
        self.drafts = drafts
        self._plan = logprobs[1] if logprobs is not None else None
        self._num_rows = 0 if picked is None else picked.numel()  # a verify chunk has 1 + drafts rows
        parts = [t for t in (picked, logprobs[0] if logprobs is not None else None) if t is not None]
        payload = parts[0] if len(parts) == 1 else torch.cat(parts)
        self._event: torch.cuda.Event | None = None
        self._host = payload
        buffer = staging.take(payload.numel())
        if buffer is not None and drafts is None:
            self._host = buffer[: payload.numel()]
            self._host.copy_(payload, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        self._read: torch.Tensor | None = None

    def _on_host(self) -> torch.Tensor:
        """The payload on the host, waiting for the step (and its copy) to end, once."""
        if self._read is None:
            if self._event is not None:
                self._event.synchronize()
            self._read = self._host.cpu()
        return self._read

    def tokens(self) -> list[int]:
        """The sampled ids on the host, waiting for the step (and its copy) to end."""
        return self._on_host()[: self._num_rows].tolist()

    def logprobs(self) -> tuple[list[list[TokenLogprob | None]], list[tuple[lp.PromptPiece, list[TokenLogprob]]]]:
        """Per request its rows' TokenLogprobs (None where not asked), as `runs()` groups the ids, and
        per prompt piece its entries."""
        if self._plan is None:
            return [[None] * len(run) for run in self.runs()], []
        host = self._on_host()
        sampled, pieces = lp.read(self._plan, self.tokens(), host[self._num_rows:])
        return self._grouped(sampled), pieces

    def _grouped(self, rows: list) -> list[list]:
        if self.drafts is None:
            return [[row] for row in rows]
        grouped, at = [], 0
        for drafts in self.drafts:
            grouped.append(rows[at:at + 1 + len(drafts)])
            at += 1 + len(drafts)
        return grouped

    def runs(self) -> list[list[int]]:
        """Per request its sampled ids: one, or 1 + its drafts of a verify step."""
        return self._grouped(self.tokens())
