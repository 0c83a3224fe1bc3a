"""The fused penalties kernel on CUDA (server/models/kernels/penalties.py) against the torch formula,
and `StepPenalties` on CUDA (which takes it) against the same rows on the CPU (the torch path).
Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from sampling_harness import penalties_case, penalties_reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_penalties_kernel_on_cuda_equals_the_torch_formula() -> None:
    from server.models.kernels.penalties import penalise

    case = penalties_case("cuda")
    torch.testing.assert_close(penalise(*case), penalties_reference(*case), rtol=1e-6, atol=1e-6)
