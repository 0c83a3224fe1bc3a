"""Expert parallelism's all-to-all (server/models/moe/dispatch.py) on gloo: ranks that each hold a
share of the experts, summed as the MoE block's all-reduce sums them, give the one-rank routed
output of every token, for token counts below, at and above the rank count, and when every pair goes
to one rank's experts."""

from __future__ import annotations

from pathlib import Path

import torch
from tp_ranks import spawn_ranks

from server.models.moe.dispatch import AllToAllDispatch
from server.models.moe.experts import grouped_experts
from server.models.parallel import group

EXPERTS, HIDDEN, INTER = 8, 16, 12
CASES = [(1, 2), (2, 2), (3, 3), (7, 2), (16, 4)]  # (tokens, top_k)


def _case(tokens: int, top_k: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=gen, dtype=torch.float64)
    gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen, dtype=torch.float64)
    down = torch.randn(EXPERTS, HIDDEN, INTER, generator=gen, dtype=torch.float64)
    weights = torch.rand(tokens, top_k, generator=gen, dtype=torch.float64).float()
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:top_k] for _ in range(tokens)])
    if seed % 2:  # every pair to the last rank's experts
        ids = ids % (EXPERTS // 4) + EXPERTS - EXPERTS // 4
    return x, gate_up, down, weights, ids


def _rank_main(rank: int, size: int, port: int, out: str) -> None:
    group.join(rank, size, torch.device("cpu"), port=port, timeout_s=60)
    per = EXPERTS // size
    held = slice(rank * per, (rank + 1) * per)
    try:
        dispatch = AllToAllDispatch(rank, size, per)
        for i, (tokens, top_k) in enumerate(CASES):
            for seed in (2 * i, 2 * i + 1):
                x, gate_up, down, weights, ids = _case(tokens, top_k, seed)
                held_up, held_down = gate_up[held], down[held]
                mine = dispatch(x, weights, ids, lambda r, w, e, g=held_up, d=held_down: grouped_experts(r, g, d, w, e))
                torch.distributed.all_reduce(mine)
                torch.save(mine, Path(out, f"{rank}-{seed}.pt"))
    finally:
        group.leave()


def test_all_to_all_equals_one_rank_for_every_token(tmp_path: Path) -> None:
    size = 4
    spawn_ranks(size, _rank_main, str(tmp_path))
    for i, (tokens, top_k) in enumerate(CASES):
        for seed in (2 * i, 2 * i + 1):
            want = grouped_experts(*_case(tokens, top_k, seed))
            for rank in range(size):
                got = torch.load(tmp_path / f"{rank}-{seed}.pt")
                assert torch.allclose(got, want, rtol=0, atol=1e-12), (tokens, top_k, seed, rank)
