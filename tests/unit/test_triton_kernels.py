"""The Triton kernels on the CPU, through Triton's interpreter (TRITON_INTERPRET=1): each kernel
against a plain torch reference on random data (paged decode with splits and sliding windows,
paged prefill after a cached prefix, RMSNorm(+add), SiLU-mul, RoPE + cache write with padding
rows, over whole heads or their first dims), and the whole runner on the Triton path token for
token against transformers.

The same kernels are compiled for the GPU in tests/gpu/test_runner_cuda.py; this file keeps their
logic (indexing, masks, windows, padding) under test where there is no GPU.
"""

from __future__ import annotations

import math
import os

import hf_reference  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from prompts import stride_prompt  # noqa: E402

pytest.importorskip("triton", reason="the Triton kernels need the triton package (test extra)")
# tests/conftest.py sets TRITON_INTERPRET=1 on machines without CUDA, before any kernel is defined;
# on a GPU machine the kernels compile and tests/gpu covers them on CUDA tensors instead
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="CUDA machine: the kernels compile there (tests/gpu covers them)")

from runner_harness import prefilled_decode_rows  # noqa: E402

from kvcache import KvCacheConfig, KVCacheManager  # noqa: E402
from server.models.attention import SeqLayout  # noqa: E402
from server.models.builtin import resolve_model  # noqa: E402
from server.models.kernels import attention as A  # noqa: E402
from server.models.kernels import elementwise as E  # noqa: E402
from server.models.model_spec import load_spec  # noqa: E402
from server.models.runner import ModelRunner, PendingTokens, SeqChunk  # noqa: E402
from server.models.triton_attention import StaticDecodePlan  # noqa: E402

SLOTS, LAYERS, TPB, KVH, D, H = 40, 3, 8, 2, 32, 8


@pytest.fixture
def pool() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(SLOTS, LAYERS, 2, TPB, KVH, D)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: list[int], lo: int, hi: int) -> torch.Tensor:
    """q [H, D] attending keys lo..hi-1 of a sequence whose blocks are `table` -> [H, D]."""
    keys = torch.cat([k[s] for s in table])[lo:hi].repeat_interleave(H // KVH, 1)
    vals = torch.cat([v[s] for s in table])[lo:hi].repeat_interleave(H // KVH, 1)
    scores = torch.einsum("hd,nhd->hn", q, keys) / math.sqrt(D)
    return torch.einsum("hn,nhd->hd", scores.softmax(-1), vals)


@pytest.mark.parametrize("window", [10**9, 12])
@pytest.mark.parametrize("splits", [1, 4])
def test_paged_decode(pool: torch.Tensor, window: int, splits: int) -> None:
    k, v = pool[:, 1, 0], pool[:, 1, 1]  # a middle layer: page stride spans every layer
    lens = [5, 17, 30, 0]  # the last row is padding: no keys, zero output
    order = torch.randperm(SLOTS).tolist()
    tables = [order[i * 8:i * 8 + math.ceil(n / TPB)] for i, n in enumerate(lens)]
    nb = max(len(t) for t in tables)
    block_table = torch.tensor([t + [0] * (nb - len(t)) for t in tables], dtype=torch.int32)
    lo = [max(0, n - window) for n in lens]
    q = torch.randn(len(lens), H, D)
    out = torch.full_like(q, float("nan"))
    A.paged_decode(q, k, v, block_table, torch.tensor(lens, dtype=torch.int32), torch.tensor(lo, dtype=torch.int32),
                   out, D**-0.5, splits)
    for i, n in enumerate(lens[:-1]):
        torch.testing.assert_close(out[i], reference(q[i], k, v, tables[i], lo[i], n), atol=1e-5, rtol=1e-5)
    assert torch.equal(out[-1], torch.zeros(H, D))


@pytest.mark.parametrize("splits", [1, 4])
def test_latent_decode_and_write(splits: int) -> None:
    """The MLA decode kernel (kernels/latent.py): every head's query [q_c, q_pe] against one latent
    row a key, the output the weighted sum of the keys' c; a padding row writes and reads nothing."""
    from server.models.kernels.latent import latent_decode, write_latent

    torch.manual_seed(1)
    rank, rope, heads = 32, 16, 4
    cache = torch.randn(SLOTS, TPB, rank + rope)
    lens, lo = [5, 30, 0], [0, 3, 0]
    tables = [torch.randperm(SLOTS)[:4].tolist() for _ in lens]
    new = torch.randn(3, rank + rope)  # each row's newest key, written first
    slot = torch.tensor([tables[0][0], tables[1][29 // TPB], -1], dtype=torch.int32)
    offset = torch.tensor([4, 29 % TPB, 0], dtype=torch.int32)
    before = cache.clone()
    write_latent(new, cache, slot, offset)
    changed = (cache != before).reshape(SLOTS, -1).any(1).nonzero().flatten().tolist()
    assert changed == sorted({tables[0][0], tables[1][3]})
    assert torch.equal(cache[tables[0][0], 4], new[0]) and torch.equal(cache[tables[1][3], 5], new[1])
    q = torch.randn(3, heads, rank + rope)
    out = torch.full((3, heads, rank), 7.0)
    scratch = A.decode_scratch(3, 1, A.group_rows(heads, 1), rank, splits, torch.device("cpu"))
    latent_decode(q, cache, torch.tensor(tables, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32),
                  torch.tensor(lo, dtype=torch.int32), out, 0.3, splits, scratch)
    for b, (n, first) in enumerate(zip(lens, lo, strict=True)):
        keys = torch.cat([cache[s] for s in tables[b]])[first:n]  # [L, rank + rope]
        want = (q[b] @ keys.T * 0.3).softmax(-1) @ keys[:, :rank] if n else torch.zeros(heads, rank)
        torch.testing.assert_close(out[b], want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("window", [10**9, 6])
def test_paged_prefill_after_a_cached_prefix(pool: torch.Tensor, window: int) -> None:
    k, v = pool[:, 2, 0], pool[:, 2, 1]
    seqs = [(9, 13), (0, 7)]  # (tokens cached before the chunk, tokens in the chunk)
    tables = [[31, 4, 17, 8], [22]]
    block_table = torch.tensor([t + [0] * (4 - len(t)) for t in tables], dtype=torch.int32)
    per_tile = A.prefill_tokens_per_tile(H, KVH)
    tiles, row = [[], [], [], []], 0
    for index, (past, new) in enumerate(seqs):
        for t0 in range(0, new, per_tile):
            for column, value in zip(tiles, (index, row + t0, past + t0, min(per_tile, new - t0)), strict=True):
                column.append(value)
        row += new
    q = torch.randn(row, H, D)
    out = torch.full_like(q, float("nan"))
    A.paged_prefill(q, k, v, out, block_table, torch.tensor(tiles, dtype=torch.int32),
                    torch.zeros(2, dtype=torch.int32), D**-0.5, window)
    row = 0
    for index, (past, new) in enumerate(seqs):
        for t in range(new):
            p = past + t
            expected = reference(q[row + t], k, v, tables[index], max(0, p - window + 1), p + 1)
            torch.testing.assert_close(out[row + t], expected, atol=1e-5, rtol=1e-5)
        row += new


def test_rms_norm_and_add_and_silu_mul() -> None:
    x, w, residual = torch.randn(5, 96), torch.randn(96), torch.randn(5, 96)
    expected = torch.nn.functional.rms_norm(x, (96,), w, 1e-6)
    torch.testing.assert_close(E.rms_norm(x, w, 1e-6), expected, atol=1e-6, rtol=1e-6)
    updated = residual.clone()
    normed = E.rms_norm(x, w, 1e-6, residual=updated)
    assert torch.equal(updated, residual + x)
    torch.testing.assert_close(normed, torch.nn.functional.rms_norm(residual + x, (96,), w, 1e-6))
    gate_up = torch.randn(4, 80)
    torch.testing.assert_close(E.silu_mul(gate_up), torch.nn.functional.silu(gate_up[:, :40]) * gate_up[:, 40:])


@pytest.mark.parametrize("rotary", [D, D // 2, 12])  # all of a head, half (GLM-4.5), a width the lanes mask
def test_rope_write_rotates_in_place_and_writes_only_real_rows(pool: torch.Tensor, rotary: int) -> None:
    """q and k rotated on their first `rotary` dims (rotate_half over those), the rest passed through."""
    qkv = torch.randn(4, H + 2 * KVH, D)
    before, cache = qkv.clone(), pool.clone()
    cos, sin = torch.randn(4, rotary), torch.randn(4, rotary)
    slot = torch.tensor([3, -1, 7, 7], dtype=torch.int32)  # row 1 is padding
    offset = torch.tensor([0, 1, 2, 5], dtype=torch.int32)
    E.rope_write(qkv, cos, sin, cache[:, 1, 0], cache[:, 1, 1], slot, offset, H, KVH)
    half, part = rotary // 2, before[..., :rotary]
    rotated = part * cos[:, None] + torch.cat((part[..., half:], part[..., :half]), -1) * sin[:, None]
    torch.testing.assert_close(qkv[:, :H + KVH, :rotary], rotated[:, :H + KVH])
    assert torch.equal(qkv[:, :H + KVH, rotary:], before[:, :H + KVH, rotary:])
    assert torch.equal(qkv[:, H + KVH:], before[:, H + KVH:])
    for t in (0, 2, 3):
        assert torch.equal(cache[slot[t], 1, 0, offset[t]], qkv[t, H:H + KVH])
        assert torch.equal(cache[slot[t], 1, 1, offset[t]], before[t, H + KVH:])
    changed = (cache != pool).reshape(SLOTS, -1).any(1).nonzero().flatten().tolist()
    assert changed == [3, 7]


@pytest.mark.parametrize("name, prompt_lens, on_device", [
    ("tiny-llama", (9, 40), False), ("tiny-qwen3-swa", (70,), False), ("tiny-llama", (9, 40), True),
    ("tiny-qwen3-moe", (9, 40), True), ("tiny-deepseek-v3", (9, 40), True), ("tiny-glm4-moe", (12,), True)])
def test_triton_runner_matches_hf_token_for_token(name: str, prompt_lens: tuple[int, ...], on_device: bool) -> None:
    """Prefill (SDPA path for a fresh prompt, paged kernel past tiny-qwen3-swa's 64-token window),
    then batched decode; float32 greedy tokens equal transformers' generate (DeepSeek: the latent
    decode kernel, the torch MLA for prefill). `on_device`: as async
    scheduling runs it, each decode step's tokens are the step before's argmax, never on the host."""
    model_dir = resolve_model(f"builtin:{name}")
    steps = 5
    layout = load_spec(model_dir).cache_layout(256, torch.float32, "cpu")
    kv = KVCacheManager(KvCacheConfig(max_tokens=2048, tokens_per_block=16), layout)
    runner = ModelRunner(model_dir, kv, dtype=torch.float32, device=torch.device("cpu"), max_num_tokens=256,
                         max_batch_size=4, kernels="triton", cuda_graphs=False)
    prompts = [stride_prompt(n) for n in prompt_lens]
    outs: list[list[int]] = [[] for _ in prompts]
    for i, p in enumerate(prompts):
        kv.admit(f"r{i}", p, num_tokens=len(p) + steps)
    picked = None
    for _ in range(steps):
        chunks = []
        for i, p in enumerate(prompts):
            tables = {w: kv.slot_table(f"r{i}", w) for w in kv.window_sizes}
            if not outs[i]:
                chunks.append(SeqChunk(p, 0, tables, True))
            else:  # on the device: a placeholder, the token is row i of `picked`
                chunks.append(SeqChunk([0 if on_device else outs[i][-1]], len(p) + len(outs[i]) - 1, tables, True))
        pending = PendingTokens(picked, {i: i for i in range(len(prompts))}) if on_device and outs[0] else None
        logits = runner.execute(chunks, pending)
        logits[:, list(runner.spec.eos_token_ids)] = float("-inf")
        picked = logits.argmax(-1)
        for i, token in enumerate(picked.tolist()):
            outs[i].append(token)
    for p, out in zip(prompts, outs, strict=True):
        assert out == hf_reference.hf_greedy(model_dir, p, steps)


@pytest.mark.parametrize("name", ["tiny-qwen3-swa", "tiny-deepseek-v3"])
def test_static_decode_plan_equals_the_eager_plan(name: str) -> None:
    """What a CUDA graph replays: the forward over a `StaticDecodePlan` (bucket of 4 rows, 3 real,
    block tables padded to max_seq_len) gives the eager step's logits (DeepSeek: the latent decode
    kernel in both, the eager step's prefill on the torch MLA)."""
    from server.models.attention import StepLayout

    model_dir = resolve_model(f"builtin:{name}")
    layout = load_spec(model_dir).cache_layout(256, torch.float32, "cpu")
    kv = KVCacheManager(KvCacheConfig(max_tokens=2048, tokens_per_block=16), layout)
    runner = ModelRunner(model_dir, kv, dtype=torch.float32, device=torch.device("cpu"), max_num_tokens=256,
                         max_batch_size=4, kernels="triton", cuda_graphs=False, max_seq_len=256)
    prompts = [[7 + (n * 11 + j * 31) % 400 for j in range(n)] for n in (5, 70, 33)]
    torch_runner = ModelRunner(model_dir, kv, dtype=torch.float32, device=torch.device("cpu"), max_num_tokens=256,
                               max_batch_size=4, kernels="torch", max_seq_len=256)
    chunks = prefilled_decode_rows(runner, prompts, 3, prefill=torch_runner)  # (the interpreter's prefill: slow)
    eager = runner.execute(chunks)  # the static run below writes the same K/V at the same places again
    plan = StaticDecodePlan(runner.attention, 4)
    seqs = StepLayout([SeqLayout(c.num_past, 1, c.slot_tables) for c in chunks], 3).seqs
    plan.fill(seqs, [c.token_ids[0] for c in chunks])
    plan.take_pending(torch.zeros(4, dtype=torch.int64))  # no picks: the host tokens stay
    logits = runner.model.forward(plan.token_ids, plan.positions, plan.meta, torch.arange(4))
    torch.testing.assert_close(logits[:3], eager, atol=1e-4, rtol=1e-4)
    assert torch.isfinite(logits[3]).all()  # the padding row attends to nothing and writes nothing
    # async scheduling: rows 0 and 2 take their tokens from the step before's sampled ids (device)
    plan.fill(seqs, [0, 4, 0], picks=[2, -1, 0])
    plan.take_pending(torch.tensor([5, 9, 3, 8]))
    assert plan.token_ids[:3].tolist() == [3, 4, 5]
    picked = runner.model.forward(plan.token_ids, plan.positions, plan.meta, torch.arange(4))
    assert torch.equal(picked[:3], logits[:3])
    # a bucket that computes 2 rows' logits, the rows `fill` names (a mixed step: prefill rows' last ones)
    some = StaticDecodePlan(runner.attention, 4, logit_rows=2)
    some.fill(seqs, [c.token_ids[0] for c in chunks], logit_rows=[2, 0])
    some.take_pending(torch.zeros(4, dtype=torch.int64))
    chosen = runner.model.forward(some.token_ids, some.positions, some.meta, some.logit_rows)
    torch.testing.assert_close(chosen, eager[[2, 0]], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("rows, bias", [(1, False), (3, True), (16, False)])
def test_skinny_linear_matches_f_linear(rows: int, bias: bool) -> None:
    """The small-batch GEMM (kernels/gemv.py) over features and a K that no block size divides."""
    from server.models.kernels.gemv import CONFIGS, skinny_linear

    torch.manual_seed(rows)
    x, w = torch.randn(rows, 200), torch.randn(150, 200)
    b = torch.randn(150) if bias else None
    for config in CONFIGS[:2]:
        torch.testing.assert_close(skinny_linear(x, w, b, config), torch.nn.functional.linear(x, w, b),
                                   atol=1e-4, rtol=1e-4)


def test_penalties_kernel_equals_the_torch_formula_and_leaves_other_rows() -> None:
    from sampling_harness import penalties_case, penalties_reference

    from server.models.kernels.penalties import penalise

    case = penalties_case("cpu")
    before = case[0].clone()
    got = penalise(*case)
    assert torch.equal(got, penalties_reference(*case))  # the same float32 ops, bit for bit
    assert torch.equal(case[0], before) and torch.equal(got[[0, 2]], before[[0, 2]])
    assert torch.isinf(got[1, ::7]).all() and not torch.equal(got[3], before[3])


@pytest.mark.parametrize("heads", [4, 20])  # 20: two blocks of 16 rows, the key row in the second
@pytest.mark.parametrize("interleave", [True, False])
def test_latent_rope_rotates_q_and_k_pe_in_place_as_the_torch_path(interleave: bool, heads: int) -> None:
    """MLA's rotary in one kernel (kernels/latent.py): every head's rope dims of q and kv_a's k_pe, in place,
    equal to the torch path's (DeepSeek's interleaved pairs and the halves), the other dims untouched."""
    from server.models.ops import TorchOps, TritonOps

    torch.manual_seed(4)
    t, nope, rope, rank = 5, 8, 16, 32
    q, kv = torch.randn(t, heads, nope + rope), torch.randn(t, rank + rope)
    angle = torch.rand(t, rope // 2) * 10
    cos = torch.cat((angle.cos(), angle.cos()), -1)
    sin = torch.cat((-angle.sin(), angle.sin()), -1)  # signed, as rope.py `cos_sin` gives it
    want_q, want_k = TorchOps(1e-6).latent_rope(q.clone(), kv.clone(), cos, sin, interleave)
    q2, kv2 = q.clone(), kv.clone()
    got_q, got_k = TritonOps(1e-6).latent_rope(q2, kv2, cos, sin, interleave)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert not torch.equal(want_q, q[..., nope:])
    assert torch.equal(q2[..., :nope], q[..., :nope]) and torch.equal(kv2[:, :rank], kv[:, :rank])
    assert got_q.data_ptr() == q2[..., nope:].data_ptr() and got_k.data_ptr() == kv2[:, rank:].data_ptr()


def test_qk_norm_normalises_each_q_and_k_head_in_place_as_the_torch_path() -> None:
    """Qwen3's per-head q and k norms in one kernel (kernels/elementwise.py `qk_norm`) on a qkv row's heads:
    the torch path's values, v untouched, written in place."""
    from server.models.ops import TorchOps, TritonOps

    torch.manual_seed(6)
    t, heads, kv_heads, d = 3, 4, 2, 32
    qkv = torch.randn(t, heads + 2 * kv_heads, d) * 3
    q_w, k_w = torch.randn(d), torch.randn(d)
    want = TorchOps(1e-6).qk_norm(qkv, q_w, k_w, heads, kv_heads)
    got = TritonOps(1e-6).qk_norm(qkv.clone(), q_w, k_w, heads, kv_heads)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(got[:, heads + kv_heads:], qkv[:, heads + kv_heads:])
    assert not torch.allclose(want[:, :heads], qkv[:, :heads])
    inplace = qkv.clone()
    assert TritonOps(1e-6).qk_norm(inplace, q_w, k_w, heads, kv_heads).data_ptr() == inplace.data_ptr()
