"""What the sampling and log-probability tests share: every output of a request kept (its logprobs
are per output). Their pair of engines is engine_harness.loopback_pair.

Imported as `import sampling_harness` (tests/ is on sys.path, as for engine_harness).
"""

from __future__ import annotations

import torch

from server.engine.core import EngineCore
from server.types import RequestOutput, TokenLogprob


def outputs_of(core: EngineCore, ids: list[str], max_steps: int = 3000) -> dict[str, list[RequestOutput]]:
    """Every output of each request, in order, stepping until all finished."""
    outs: dict[str, list[RequestOutput]] = {rid: [] for rid in ids}
    for _ in range(max_steps):
        for output in core.step():
            outs.setdefault(output.request_id, []).append(output)
        if all(o and o[-1].finished for o in outs.values()) and not core.has_work():
            return outs
    raise AssertionError(f"requests did not finish within {max_steps} steps")


def tokens_of(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def logprobs_of(outs: list[RequestOutput]) -> list[TokenLogprob]:
    """The outputs' logprobs, checked to be one per new token."""
    entries: list[TokenLogprob] = []
    for o in outs:
        assert o.logprobs is not None and len(o.logprobs) == len(o.new_token_ids), o
        entries += o.logprobs
    return entries


def penalties_case(device: str) -> tuple:
    """Random logits (some -inf, as a grammar's mask leaves them), counts and prompt flags; three of
    five rows penalised, out of order, from four count rows."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 1500, generator=g) * 4
    logits[1, ::7] = float("-inf")
    counts = torch.randint(0, 3, (4, 1500), generator=g, dtype=torch.int32)
    counts *= torch.rand(4, 1500, generator=g) < 0.1
    in_prompt = torch.rand(4, 1500, generator=g) < 0.05
    index, count_rows = torch.tensor([3, 1, 4]), torch.tensor([2, 0, 3])
    rep, freq, pres = torch.tensor([1.3, 0.8, 1.0]), torch.tensor([0.5, 0.0, -0.4]), torch.tensor([0.2, 1.1, 0.0])
    parts = (logits, index, count_rows, counts.to(torch.int32), in_prompt, rep, freq, pres)
    return tuple(t.to(device) for t in parts)


def penalties_reference(logits, index, count_rows, counts, in_prompt, rep, freq, pres) -> torch.Tensor:
    """The torch path's formula (server/engine/penalties.py), row by row."""
    out = logits.clone()
    for j, (row, crow) in enumerate(zip(index.tolist(), count_rows.tolist(), strict=True)):
        x, occurs = out[row], counts[crow].float()
        seen = (occurs > 0) | in_prompt[crow]
        x = torch.where(seen, torch.where(x > 0, x / rep[j], x * rep[j]), x)
        out[row] = x - freq[j] * occurs - pres[j] * (occurs > 0).float()
    return out

