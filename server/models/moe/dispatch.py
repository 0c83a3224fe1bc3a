"""Expert parallelism's all-to-all (`expert_dispatch: all_to_all`, docs/MODELS.md): rank r routes the
r-th of `size` equal slices of the tokens (tensor-parallel attention leaves every token on every
rank), sends each (token, expert) pair to the expert's rank, and gets the weighted outputs back.
Every buffer has a fixed size, so a step is three `all_to_all_single` calls of equal splits, no count
crosses to the host, and it runs inside CUDA graphs. Pairs go in expert order and their outputs are
added back in that order, as the one-rank path sums them. The result holds this rank's slice (zeros
elsewhere); the block's all-reduce puts every slice on every rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from server.models.moe.experts import expert_load

# (rows [N, hidden], weights [N, 1] float32, local expert ids [N, 1]) -> [N, hidden]; an id equal to the
# experts held here is no expert (a padding row) and gives zeros
LocalExperts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class AllToAllDispatch:
    def __init__(self, rank: int, size: int, experts_per_rank: int) -> None:
        self.rank, self.size, self.per = rank, size, experts_per_rank

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                 experts: LocalExperts) -> torch.Tensor:
        """x [T, hidden] (the same on every rank), weights/ids [T, top_k] (global expert ids) -> the
        routed experts' sum for this rank's slice of the tokens, zeros for the other rows [T, hidden]."""
        tokens, top_k = ids.shape
        per_slice = -(-tokens // self.size)
        lo, hi = min(tokens, self.rank * per_slice), min(tokens, (self.rank + 1) * per_slice)
        pairs = per_slice * top_k  # each destination's segment holds all of a slice's pairs at most
        flat_ids = _padded(ids[lo:hi], per_slice, fill=0).flatten()
        flat_w = _padded(weights[lo:hi], per_slice, fill=0.0).flatten()  # padding tokens weigh nothing
        order = flat_ids.argsort(stable=True)  # by expert, so by destination rank
        sorted_ids = flat_ids[order]
        dest = sorted_ids // self.per
        counts = expert_load(dest, self.size)  # pairs per destination, on the device
        slot = dest * pairs + torch.arange(pairs, device=x.device) - (counts.cumsum(0) - counts)[dest]
        token = order // top_k  # within the slice; a padding token reads a real row, at weight 0
        segments = self.size * pairs
        rows = _scattered(x.index_select(0, (lo + token).clamp(max=tokens - 1)), slot, segments)
        local = _scattered((sorted_ids - dest * self.per)[:, None], slot, segments, fill=self.per)
        scale = _scattered(flat_w[order][:, None], slot, segments, fill=0.0)
        done = experts(self._exchange(rows), self._exchange(scale), self._exchange(local))
        back = self._exchange(done)[slot]  # the outputs of this slice's pairs, in expert order
        out = torch.zeros_like(x)
        out[lo:hi] = back.new_zeros(per_slice, x.shape[1]).index_add_(0, token, back)[:hi - lo]
        return out

    def _exchange(self, send: torch.Tensor) -> torch.Tensor:
        """Segment d of `send` to rank d; segment s of the result from rank s."""
        got = torch.empty_like(send)
        dist.all_to_all_single(got, send.contiguous())
        return got


def _padded(t: torch.Tensor, rows: int, fill: float) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_full((rows - t.shape[0], *t.shape[1:]), fill)])


def _scattered(values: torch.Tensor, slot: torch.Tensor, rows: int, fill: float = 0.0) -> torch.Tensor:
    out = values.new_full((rows, *values.shape[1:]), fill)
    out[slot] = values
    return out
