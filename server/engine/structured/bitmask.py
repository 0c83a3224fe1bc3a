"""A step's token bitmask: filled on the CPU while the device runs the forward, applied on the device.
One int32 row of ceil(vocab / 32) words per sampled row, bit j of word w allowing token 32 * w + j
(llguidance's layout; unconstrained rows allow every token). On CUDA it is filled in pinned memory and
goes up without waiting (torch keeps the pinned block until the copy has run).
"""

from __future__ import annotations

import llguidance
import torch

from server.engine.structured.matcher import RequestGrammar

_executor: llguidance.LLExecutor | None = None
_shifts: dict[torch.device, torch.Tensor] = {}


def _pool() -> llguidance.LLExecutor:
    """llguidance's threads that fill several rows at once (without the GIL)."""
    global _executor
    if _executor is None:
        _executor = llguidance.LLExecutor()
    return _executor


class StepMask:
    """The allowed tokens of a step's rows (`bits` [rows, words] int32 on the CPU)."""

    def __init__(self, bits: torch.Tensor) -> None:
        self.bits = bits

    @classmethod
    def fill(cls, rows: dict[int, RequestGrammar], num_rows: int, vocab_size: int, device: torch.device) -> StepMask:
        """Rows `rows` (row index -> grammar) filled by their grammars, the others allowing everything."""
        words = (vocab_size + 31) // 32
        bits = torch.empty((num_rows, words), dtype=torch.int32, pin_memory=device.type == "cuda").fill_(-1)
        if len(rows) == 1:
            (row, grammar), = rows.items()
            grammar.fill(bits[row])
        else:
            matchers = [(grammar.matcher, row) for row, grammar in rows.items()]
            _pool().unsafe_compute_mask_ptr(matchers, bits.data_ptr(), words * 4, num_rows)
        return cls(bits)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [rows, vocab] with the refused tokens at -inf (a new tensor: the raw logits stay)."""
        device = logits.device
        words = self.bits.to(device, non_blocking=True)
        shifts = _shifts.get(device)
        if shifts is None:
            shifts = _shifts[device] = torch.arange(32, dtype=torch.int32, device=device)
        allowed = ((words.unsqueeze(-1) >> shifts) & 1).view(words.shape[0], -1)[:, :logits.shape[-1]]
        return logits.masked_fill(allowed == 0, float("-inf"))
