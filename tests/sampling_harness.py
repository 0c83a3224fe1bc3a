"""What the sampling and log-probability tests share: every output of a request kept (its logprobs
are per output). Their pair of engines is engine_harness.loopback_pair.

Imported as `import sampling_harness` (tests/ is on sys.path, as for engine_harness).
"""

from __future__ import annotations

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
