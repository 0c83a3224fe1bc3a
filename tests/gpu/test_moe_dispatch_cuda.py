"""Expert parallelism's all-to-all (server/models/moe/dispatch.py) on CUDA, in a one-rank NCCL group:
captured in a CUDA graph (so nothing in it asks the host for a count) and replayed on new inputs, it
gives the grouped Triton experts' output. The several-rank sums are tested on gloo
(tests/unit/test_moe_dispatch.py). Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_the_dispatch_runs_in_a_cuda_graph() -> None:
    from server.models.kernels.moe import fused_experts
    from server.models.moe.dispatch import AllToAllDispatch
    from server.models.parallel import group

    experts, hidden, inter, top_k, tokens = 16, 256, 128, 4, 24
    store = group.open_store(1, timeout_s=60)
    group.join(0, 1, torch.device("cuda", 0), store=store, timeout_s=60)
    try:
        gate_up = torch.randn(experts, 2 * inter, hidden, dtype=torch.bfloat16, device="cuda") * 0.05
        down = torch.randn(experts, hidden, inter, dtype=torch.bfloat16, device="cuda") * 0.05
        x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device="cuda")
        ids = torch.rand(tokens, experts, device="cuda").topk(top_k, dim=1).indices
        weights = torch.rand(tokens, top_k, device="cuda")
        dispatch = AllToAllDispatch(0, 1, experts)

        def step() -> torch.Tensor:
            return dispatch(x, weights, ids, lambda r, w, e: fused_experts(r, gate_up, down, w, e))

        step()  # compile the kernels outside the capture
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            out = step()
        torch.cuda.current_stream().wait_stream(stream)
        for _ in range(2):
            x.copy_(torch.randn_like(x))
            ids.copy_(torch.rand(tokens, experts, device="cuda").topk(top_k, dim=1).indices)
            graph.replay()
            want = fused_experts(x, gate_up, down, weights, ids)
            err = (out.float() - want.float()).abs().max().item()
            assert err <= 0.02 * want.float().abs().max().item(), err
    finally:
        group.leave()
