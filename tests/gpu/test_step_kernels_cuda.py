"""The kernels that replace a decode step's small torch ops, compiled on CUDA, in bf16: what Triton's CPU
interpreter cannot check (it truncates float32 -> bf16 casts, and runs a program as one step, so a
missing barrier never shows). Each against the torch path it replaces, on the same device:
MLA's rotary (kernels/latent.py) and the MoE gate's top-k (kernels/route.py) round as torch does;
`align` (kernels/moe.py) equals the torch sort bit for bit at every pair class; the per-head q/k norm
(kernels/elementwise.py) is within one bf16 step of torch. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
BF16 = torch.bfloat16


def _cos_sin(t: int, rope: int) -> tuple[torch.Tensor, torch.Tensor]:
    angle = torch.rand(t, rope // 2, device="cuda") * 100
    return (torch.cat((angle.cos(), angle.cos()), -1).to(BF16),
            torch.cat((-angle.sin(), angle.sin()), -1).to(BF16))  # signed, as rope.py `cos_sin`


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("heads", [16, 128])  # DeepSeek-V2-Lite's and V3's
def test_latent_rope_in_bf16_equals_the_torch_path_bit_for_bit(interleave: bool, heads: int) -> None:
    from server.models.ops import TorchOps, TritonOps

    torch.manual_seed(heads)
    t, nope, rope, rank = 37, 128, 64, 512
    q = torch.randn(t, heads, nope + rope, device="cuda").to(BF16)
    kv = torch.randn(t, rank + rope, device="cuda").to(BF16)
    cos, sin = _cos_sin(t, rope)
    want = TorchOps(1e-6).latent_rope(q.clone(), kv.clone(), cos, sin, interleave)
    got = TritonOps(1e-6).latent_rope(q.clone(), kv.clone(), cos, sin, interleave)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_qk_norm_in_bf16_is_the_torch_path_to_one_step_of_bf16() -> None:
    from server.models.ops import TorchOps, TritonOps

    torch.manual_seed(1)
    heads, kv_heads, d = 32, 4, 128  # Qwen3-30B-A3B's attention
    qkv = (torch.randn(300, heads + 2 * kv_heads, d, device="cuda") * 4).to(BF16)
    q_w, k_w = (torch.rand(d, device="cuda") + 0.5).to(BF16), (torch.rand(d, device="cuda") + 0.5).to(BF16)
    want = TorchOps(1e-6).qk_norm(qkv, q_w, k_w, heads, kv_heads).float()
    got = TritonOps(1e-6).qk_norm(qkv.clone(), q_w, k_w, heads, kv_heads).float()
    assert ((got - want).abs() <= want.abs() * 2**-7 + 1e-6).all()


@pytest.mark.parametrize(("experts", "top_k", "norm", "sigmoid"), [(128, 8, True, False), (64, 6, False, False),
                                                                   (60, 4, True, True)])
def test_fused_top_k_in_bf16_picks_torchs_experts_and_rounds_their_weights(experts: int, top_k: int, norm: bool,
                                                                           sigmoid: bool) -> None:
    from server.models.kernels.route import fused_topk

    torch.manual_seed(experts)
    logits = torch.randn(200, experts, device="cuda")  # float32 (DeepSeek's router): no tied logits
    scores = logits.sigmoid() if sigmoid else logits.softmax(-1)
    want_w, want_ids = scores.topk(top_k, dim=-1)
    if norm:
        want_w = want_w / (want_w.sum(-1, keepdim=True) + (1e-20 if sigmoid else 0.0))
    want_w = want_w.to(BF16).float()
    load = torch.zeros(experts, dtype=torch.int64, device="cuda")
    x = torch.empty(1, dtype=BF16, device="cuda")  # (its dtype: the weights rounded to bf16)
    got_w, got_ids = fused_topk(logits, top_k, sigmoid, norm, 1.0, 1e-20 if sigmoid else 0.0, x, load)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=2**-8, atol=0)  # GPU exp and division: one bf16 step at most
    assert torch.equal(load, torch.bincount(want_ids.flatten(), minlength=experts))


@pytest.mark.parametrize("pairs_class", [8, 64, 256, 1024])
@pytest.mark.parametrize("block_m", [16, 32, 64])
def test_align_in_one_program_equals_the_torch_sort_on_the_device(pairs_class: int, block_m: int,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from server.models.kernels import moe

    top_k, experts = 8, 128
    tokens = max(1, pairs_class // top_k - 3)
    skew = torch.rand(tokens, experts + 1, device="cuda") ** 4 * torch.linspace(1, 20, experts + 1, device="cuda")
    ids = skew.topk(top_k, dim=1).indices  # the last id (E: held elsewhere) often taken, loads uneven
    got = moe.align(ids, experts, block_m)
    monkeypatch.setattr(moe, "ALIGN_PAIRS", 0)
    want = moe.align(ids, experts, block_m)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
