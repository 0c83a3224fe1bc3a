"""The attention paths over an FP8 KV cache. The portable torch backend (CPU and GPU) writes
e4m3(K / k_scale), e4m3(V / v_scale) and attends over the dequantized blocks; the Triton kernels
(here through Triton's interpreter) write the very same bytes and read them back the same way:
rope_write's codes equal torch's float32 -> float8_e4m3fn rounding bit for bit (every code and every
midpoint between two), the paged decode and prefill kernels equal attention over the dequantized
cache, and the runner on the Triton path gives the torch path's tokens with the same FP8 cache."""

from __future__ import annotations

import math
import os

import pytest
import torch
from prompts import stride_prompt
from runner_harness import prefilled_decode_rows

from kvcache import CacheLayout, KvCacheConfig, KVCacheManager, KVFormat
from kvcache.kv_scales import as_float32
from kvcache.layout import inverse_scale, quantize_fp8
from server.models.attention import SeqLayout, StepLayout, TorchPagedAttention
from server.models.builtin import resolve_model
from server.models.kv_format import kv_cache_layout
from server.models.model_spec import load_spec
from server.models.runner import ModelRunner, SeqChunk

FP8 = torch.float8_e4m3fn
H, KVH, D, TPB = 8, 2, 32, 8
K_SCALE, V_SCALE = 0.0123, 0.0071  # typical: |K| up to ~5.5, |V| up to ~3.2
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="Triton's interpreter (no CUDA here); tests/gpu compiles the kernels")


def _dequantized(cache: torch.Tensor, scale: float) -> torch.Tensor:
    return cache.float() * as_float32(scale)


def test_quantize_fp8_saturates_and_rounds_to_nearest_even():
    x = torch.tensor([1000.0, -1000.0, 448.0, 1.0625, 1.1875, 2.0**-10, 3 * 2.0**-10, 0.0])
    assert quantize_fp8(x, torch.tensor(1.0)).float().tolist() == [448.0, -448.0, 448.0, 1.0, 1.25, 0.0,
                                                                   2.0**-8, 0.0]
    assert inverse_scale(0.1) == as_float32(10.0)
    assert quantize_fp8(torch.tensor([0.1]), torch.tensor(10.0)).item() == 1.0


def _cache(layers: int = 1, scales: bool = True) -> KVCacheManager:
    lay = CacheLayout((64,) * layers, KVFormat(FP8, KVH, D, **(
        {"k_scales": (K_SCALE,) * layers, "v_scales": (V_SCALE,) * layers} if scales else {})), "cpu", 64)
    return KVCacheManager(KvCacheConfig(tokens_per_block=TPB, max_tokens=16 * TPB), lay)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hi: int) -> torch.Tensor:
    """q [H, D] attending keys 0..hi-1 of k, v [n, KVH, D] (float32) -> [H, D]."""
    keys, vals = k[:hi].repeat_interleave(H // KVH, 1), v[:hi].repeat_interleave(H // KVH, 1)
    scores = torch.einsum("hd,nhd->hn", q, keys) / math.sqrt(D)
    return torch.einsum("hn,nhd->hd", scores.softmax(-1), vals)


def test_the_torch_backend_writes_fp8_codes_and_attends_over_the_dequantized_cache():
    torch.manual_seed(0)
    kv = _cache()
    attention = TorchPagedAttention(kv, 1, H, D, torch.float32)
    n = 13  # a prefill of 13 tokens over two blocks
    kv.admit("r", list(range(n)))
    tables = {64: kv.slot_table("r", 64)}
    layout = StepLayout([SeqLayout(0, n, tables)], num_decode=0)
    qkv = torch.randn(n, H + 2 * KVH, D) * 2
    cos, sin = torch.ones(n, D), torch.zeros(n, D)  # no rotation: K is written as it comes
    out = attention.forward(0, qkv.clone(), cos, sin, attention.plan(layout, torch.arange(n)))
    k_cache, v_cache = kv.layer_cache(0)
    rows = lambda c: torch.cat([c[s] for s in tables[64]])[:n]  # noqa: E731  [n, KVH, D] in token order
    k8, v8 = rows(k_cache), rows(v_cache)
    assert k8.dtype == FP8
    assert torch.equal(k8.view(torch.uint8), quantize_fp8(qkv[:, H:H + KVH], torch.tensor(inverse_scale(K_SCALE)))
                       .view(torch.uint8))
    assert torch.equal(v8.view(torch.uint8), quantize_fp8(qkv[:, H + KVH:], torch.tensor(inverse_scale(V_SCALE)))
                       .view(torch.uint8))
    k, v = _dequantized(k8, K_SCALE), _dequantized(v8, V_SCALE)
    for t in range(n):
        torch.testing.assert_close(out[t], _reference(qkv[t, :H], k, v, t + 1), atol=1e-5, rtol=1e-5)
    assert (k - qkv[:, H:H + KVH]).abs().max() > 0  # the cache holds rounded values, not the originals


def test_an_fp8_cache_needs_the_models_dtype():
    with pytest.raises(ValueError, match="an FP8 KV cache needs the model's dtype"):
        TorchPagedAttention(_cache(), 1, H, D)


try:  # the Triton kernels' tests run where Triton is installed (the test extra)
    import triton
    import triton.language as tl

    from server.models.kernels.elementwise import e4m3_bits

    @triton.jit
    def _codes(X, Y, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(Y + i, e4m3_bits(tl.load(X + i)).to(tl.uint8))
except ImportError:
    interpreted = pytest.mark.skip(reason="the Triton kernels need the triton package (test extra)")


@interpreted
def test_e4m3_bits_equal_torchs_rounding_for_every_code_and_midpoint():
    values = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    values = values[values.isfinite()].unique()
    mids = (values[1:] + values[:-1]) / 2
    up, down = torch.nextafter(mids, torch.tensor(1e9)), torch.nextafter(mids, torch.tensor(-1e9))
    torch.manual_seed(1)
    x = torch.cat([values, mids, up, down, torch.tensor([1e9, -1e9, 448.5, -449.0, 1e-30]),
                   torch.randn(4000) * 50, torch.randn(4000) * 1e-3])
    n = triton.next_power_of_2(x.numel())
    x = torch.cat([x, torch.zeros(n - x.numel())])
    y = torch.empty(n, dtype=torch.uint8)
    _codes[(1,)](x, y, N=n)
    assert torch.equal(y, x.clamp(-448, 448).to(FP8).view(torch.uint8))


@interpreted
def test_rope_write_stores_the_torch_paths_fp8_bytes():
    from server.models.kernels import elementwise as E

    torch.manual_seed(2)
    kv = _cache(layers=2)
    k_cache, v_cache = kv.layer_cache(1)
    qkv = torch.randn(4, H + 2 * KVH, D) * 2
    before = qkv.clone()
    cos, sin = torch.randn(4, D), torch.randn(4, D)
    slot = torch.tensor([3, -1, 7, 7], dtype=torch.int32)  # row 1 is padding
    offset = torch.tensor([0, 1, 2, 5], dtype=torch.int32)
    E.rope_write(qkv, cos, sin, k_cache, v_cache, slot, offset, H, KVH, inverse_scale(K_SCALE),
                 inverse_scale(V_SCALE))
    k_codes = quantize_fp8(qkv[:, H:H + KVH], torch.tensor(inverse_scale(K_SCALE))).view(torch.uint8)
    v_codes = quantize_fp8(before[:, H + KVH:], torch.tensor(inverse_scale(V_SCALE))).view(torch.uint8)
    for t in (0, 2, 3):
        assert torch.equal(k_cache[slot[t], offset[t]].view(torch.uint8), k_codes[t])
        assert torch.equal(v_cache[slot[t], offset[t]].view(torch.uint8), v_codes[t])
    written = kv.pool(64).view(torch.uint8).reshape(16, -1).ne(0).any(1).nonzero().flatten().tolist()
    assert written == [3, 7]  # nothing else, and not layer 0 of those slots
    assert not kv.pool(64)[:, 0].view(torch.uint8).any()


@interpreted
@pytest.mark.parametrize("window", [10**9, 12])
def test_paged_decode_and_prefill_read_fp8_with_the_layers_scales(window: int):
    from server.models.kernels import attention as A

    torch.manual_seed(3)
    slots = 12
    k8 = (torch.randn(slots, TPB, KVH, D) * 3 / K_SCALE).clamp(-448, 448).to(FP8)
    v8 = (torch.randn(slots, TPB, KVH, D) * 2 / V_SCALE).clamp(-448, 448).to(FP8)
    k, v = _dequantized(k8, K_SCALE), _dequantized(v8, V_SCALE)
    table = [5, 2, 9, 0]
    keys, vals = torch.cat([k[s] for s in table]), torch.cat([v[s] for s in table])
    lens = [30, 9]
    q = torch.randn(2, H, D)
    out = torch.full_like(q, float("nan"))
    lo = [max(0, n - window) for n in lens]
    A.paged_decode(q, k8, v8, torch.tensor([table, table], dtype=torch.int32), torch.tensor(lens, dtype=torch.int32),
                   torch.tensor(lo, dtype=torch.int32), out, D**-0.5, 2, k_scale=K_SCALE, v_scale=V_SCALE)
    for i, n in enumerate(lens):
        torch.testing.assert_close(out[i], _window_reference(q[i], keys, vals, lo[i], n), atol=1e-5, rtol=1e-5)
    past, new = 17, 9  # a chunk after a cached prefix
    qp = torch.randn(new, H, D)
    outp = torch.full_like(qp, float("nan"))
    tiles = torch.tensor([[0], [0], [past], [new]], dtype=torch.int32)
    A.paged_prefill(qp, k8, v8, outp, torch.tensor([table], dtype=torch.int32), tiles,
                    torch.zeros(1, dtype=torch.int32), D**-0.5, window, k_scale=K_SCALE, v_scale=V_SCALE)
    for t in range(new):
        p = past + t
        torch.testing.assert_close(outp[t], _window_reference(qp[t], keys, vals, max(0, p - window + 1), p + 1),
                                   atol=1e-5, rtol=1e-5)


@interpreted
def test_paged_decode_of_bf16_queries_over_fp8_multiplies_in_float16():
    """bf16 queries over an FP8 cache: K and V widen to float16 and the products run there (the q
    pre-scaled); the output is attention over the dequantized cache to bf16's rounding."""
    from server.models.kernels import attention as A

    torch.manual_seed(5)
    slots = 12
    k8 = (torch.randn(slots, TPB, KVH, D) * 3 / K_SCALE).clamp(-448, 448).to(FP8)
    v8 = (torch.randn(slots, TPB, KVH, D) * 2 / V_SCALE).clamp(-448, 448).to(FP8)
    k, v = _dequantized(k8, K_SCALE), _dequantized(v8, V_SCALE)
    table, lens = [5, 2, 9, 0], [30, 9]
    keys, vals = torch.cat([k[s] for s in table]), torch.cat([v[s] for s in table])
    q = torch.randn(2, H, D).bfloat16()
    assert A.fp16_dot(q, k8) and not A.fp16_dot(q.float(), k8) and not A.fp16_dot(q, k8.bfloat16())
    out = torch.full_like(q, float("nan"))
    A.paged_decode(q, k8, v8, torch.tensor([table, table], dtype=torch.int32), torch.tensor(lens, dtype=torch.int32),
                   torch.zeros(2, dtype=torch.int32), out, D**-0.5, 2, k_scale=K_SCALE, v_scale=V_SCALE)
    for i, n in enumerate(lens):
        want = _window_reference(q[i].float(), keys, vals, 0, n)
        torch.testing.assert_close(out[i].float(), want, atol=2e-2, rtol=2e-2)


def _window_reference(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    return _reference(q, keys[lo:], vals[lo:], hi - lo)


def _fp8_runner(model_dir, kernels: str, scales: str | None = None, kv: KVCacheManager | None = None) -> ModelRunner:
    config = KvCacheConfig(max_tokens=2048, tokens_per_block=16, dtype="fp8", scales=scales)
    kv = kv or KVCacheManager(config, kv_cache_layout(config, load_spec(model_dir), 256, torch.float32, "cpu"))
    return ModelRunner(model_dir, kv, dtype=torch.float32, device=torch.device("cpu"), max_num_tokens=256,
                       max_batch_size=4, kernels=kernels, cuda_graphs=False, max_seq_len=256)


def _greedy(runner: ModelRunner, prompts: list[list[int]], steps: int) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy tokens, and the last decode step's logits."""
    kv = runner.kv
    for i, p in enumerate(prompts):
        kv.admit(f"r{i}", p, num_tokens=len(p) + steps)
    tables = [{w: kv.slot_table(f"r{i}", w) for w in kv.window_sizes} for i in range(len(prompts))]
    outs: list[list[int]] = [[] for _ in prompts]
    for _ in range(steps):
        chunks = [SeqChunk(p, 0, t, True) if not o else SeqChunk([o[-1]], len(p) + len(o) - 1, t, True)
                  for p, t, o in zip(prompts, tables, outs, strict=True)]
        logits = runner.execute(chunks)
        for out, token in zip(outs, logits.argmax(-1).tolist(), strict=True):
            out.append(token)
    return outs, logits


@interpreted
@pytest.mark.parametrize("dense", ["auto", "triton"])
def test_the_triton_runner_gives_the_torch_runners_tokens_with_the_same_fp8_cache(tmp_path, monkeypatch, dense):
    """tiny-story (trained: its greedy choices are clear), calibrated scales: two fresh prompts, then
    batched decode over the FP8 cache. With the paged prefill kernel for every prompt (`triton`),
    both paths attend over the same dequantized cache and the logits agree to float32 rounding (a code
    rounded the other way after a last-bit difference upstream moves them by ~1e-3); with
    the dense prefill (`auto`) a prompt attends over its own K/V before they are rounded (the torch
    path over the cache's), so the logits move by what FP8 rounding moves them, and the tokens hold."""
    from kvcache.kv_scales import write_scales

    monkeypatch.setenv("PDSERVE_DENSE_PREFILL", dense)
    model_dir = resolve_model("builtin:tiny-story")
    scales = tmp_path / "scales.json"
    write_scales(scales, [0.011, 0.018, 0.026, 0.021], [0.0018, 0.007, 0.0095, 0.0101])
    prompts = [stride_prompt(40), stride_prompt(23)]
    want, want_logits = _greedy(_fp8_runner(model_dir, "torch", str(scales)), prompts, 3)  # 2 batched decodes
    got, got_logits = _greedy(_fp8_runner(model_dir, "triton", str(scales)), prompts, 3)
    assert got == want
    tolerance = 5e-3 if dense == "triton" else 0.5
    torch.testing.assert_close(got_logits, want_logits, atol=tolerance, rtol=0)


@interpreted
def test_a_static_decode_plan_over_an_fp8_cache_equals_the_eager_step():
    """What a CUDA graph replays (a `StaticDecodePlan`: a bucket of 4 rows, 3 real) over an FP8 cache
    gives the eager decode step's logits: the layers' scales are the same launch arguments."""
    model_dir = resolve_model("builtin:tiny-qwen3-swa")
    runner = _fp8_runner(model_dir, "triton")
    prompts = [[7 + (n * 11 + j * 31) % 400 for j in range(n)] for n in (5, 70, 17)]  # 70: past the window
    # the torch path prefills (it writes the Triton kernels' e4m3 bits, and Triton's interpreter would
    # take most of a minute over the 92 tokens); the decode step is the Triton path's, eager and static
    chunks = prefilled_decode_rows(runner, prompts, 3, prefill=_fp8_runner(model_dir, "torch", kv=runner.kv))
    eager = runner.execute(chunks)
    from server.models.triton_attention import StaticDecodePlan

    plan = StaticDecodePlan(runner.attention, 4)
    plan.fill([SeqLayout(c.num_past, 1, c.slot_tables) for c in chunks], [c.token_ids[0] for c in chunks])
    plan.take_pending(torch.zeros(4, dtype=torch.int64))
    logits = runner.model.forward(plan.token_ids, plan.positions, plan.meta, torch.arange(4))
    torch.testing.assert_close(logits[:3], eager, atol=1e-4, rtol=1e-4)
    assert torch.isfinite(logits[3]).all()
