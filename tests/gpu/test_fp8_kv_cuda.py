"""An FP8 KV cache on CUDA (skipped without it): the compiled kernels write torch's e4m3 bytes bit for
bit; the trained `builtin:tiny-story` in bfloat16 with the Triton kernels and CUDA graphs gives
logits within a stated tolerance of the bf16 cache's, teacher-forced over 64 decode steps (the same
tokens in, so only the cache differs), and graphs replay what eager computes; a pool sized from free
GPU memory holds twice the tokens of bf16.

Tolerance, relative L2 error of each row of logits against the bf16 cache's: mean <= 0.08, max
<= 0.25, and the argmax agrees on >= 85% of rows. On the CPU (float32 model and cache, torch path)
the same comparison measured mean 0.036-0.037, max 0.07-0.12 and 94-95% argmax agreement; a wrong
scale or a misread code is O(1)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from kvcache import KvCacheConfig, KVCacheManager
from kvcache.group import primary_tokens
from kvcache.kv_scales import write_scales
from kvcache.layout import inverse_scale, quantize_fp8
from pdserve_bench import tiny_story_corpus as corpus
from server.models.builtin import resolve_model
from server.models.calibrate_kv import calibrate
from server.models.kv_format import kv_cache_layout
from server.models.model_spec import load_spec
from server.models.runner import ModelRunner, SeqChunk

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

STORY = "builtin:tiny-story"
PROMPT, STEPS, ROWS = 96, 64, 8
DEVICE = torch.device("cuda")


@pytest.fixture(scope="module")
def story(tmp_path_factory):
    """The model, its calibrated scales (64k tokens of its training text), and ROWS token sequences
    of PROMPT + STEPS tokens of that text."""
    model_dir = resolve_model(STORY)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer.encode("\n\n".join(corpus.plain_text(d) for d in corpus.documents()))
    k, v = calibrate(model_dir, ids[:65536], seq_len=2048, device=DEVICE, dtype=torch.bfloat16)
    scales = tmp_path_factory.mktemp("fp8") / "scales.json"
    write_scales(scales, k, v)
    span = PROMPT + STEPS
    seqs = [ids[70_000 + i * 3 * span:70_000 + i * 3 * span + span] for i in range(ROWS)]
    return model_dir, str(scales), seqs


def _runner(model_dir, kv_config: KvCacheConfig, graphs: bool) -> ModelRunner:
    layout = kv_cache_layout(kv_config, load_spec(model_dir), 1024, torch.bfloat16, DEVICE)
    kv = KVCacheManager(kv_config, layout)
    runner = ModelRunner(model_dir, kv, dtype=torch.bfloat16, device=DEVICE, max_num_tokens=1024,
                         max_batch_size=ROWS, kernels="triton", cuda_graphs=graphs, max_seq_len=1024)
    runner.warm_up()
    assert (runner.graphs is not None and bool(runner.graphs.graphs)) == graphs
    return runner


def _teacher_forced(runner: ModelRunner, seqs: list[list[int]]) -> torch.Tensor:
    """float32 logits [1 + STEPS, ROWS, vocab]: the prompts' last, then one per decode step, each
    step's input the sequences' own next token (not the argmax)."""
    kv = runner.kv
    for i, s in enumerate(seqs):
        kv.admit(f"r{i}", s)
    tables = [{w: kv.slot_table(f"r{i}", w) for w in kv.window_sizes} for i in range(len(seqs))]
    # a replayed step's logits are its graph's output buffer, overwritten by the next replay: copy each at once
    out = [runner.execute([SeqChunk(s[:PROMPT], 0, t, True) for s, t in zip(seqs, tables, strict=True)]).float().cpu()]
    for step in range(STEPS):
        out.append(runner.execute([SeqChunk([s[PROMPT + step]], PROMPT + step, t, True)
                                   for s, t in zip(seqs, tables, strict=True)]).float().cpu())
    return torch.stack(out)


def test_fp8_kv_logits_are_within_tolerance_of_bf16_kv_with_graphs(story):
    model_dir, scales, seqs = story
    base = KvCacheConfig(tokens_per_block=32, max_tokens=ROWS * 1024)
    reference = _teacher_forced(_runner(model_dir, base, graphs=True), seqs)
    fp8 = KvCacheConfig(tokens_per_block=32, max_tokens=ROWS * 1024, dtype="fp8", scales=scales)
    graphed = _runner(model_dir, fp8, graphs=True)
    assert graphed.kv.pool(graphed.kv.window_sizes[0]).dtype == torch.float8_e4m3fn
    got = _teacher_forced(graphed, seqs)
    error = (got - reference).norm(dim=-1) / reference.norm(dim=-1)  # [steps, rows]
    agree = (got.argmax(-1) == reference.argmax(-1)).float().mean().item()
    print(f"\nFP8 KV vs bf16 KV (bf16 model, Triton, graphs): relative L2 of logits mean {error.mean():.4f}, "
          f"max {error.max():.4f}; argmax agreement {agree:.3f} over {error.numel()} rows")
    assert error.mean() <= 0.08 and error.max() <= 0.25 and agree >= 0.85
    eager = _teacher_forced(_runner(model_dir, fp8, graphs=False), seqs)
    torch.testing.assert_close(got, eager, atol=0.05, rtol=0.0)  # the replayed graphs compute what eager does
    assert (got.argmax(-1) == eager.argmax(-1)).float().mean() >= 0.99


def test_compiled_rope_write_stores_torchs_e4m3_bytes():
    from server.models.kernels.elementwise import rope_write

    torch.manual_seed(0)
    heads, kv_heads, dim, tokens = 8, 2, 128, 64
    scale_k, scale_v = 0.0123, 0.0071
    k_cache = torch.zeros(16, 32, kv_heads, dim, dtype=torch.float8_e4m3fn, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    qkv = (torch.randn(tokens, heads + 2 * kv_heads, dim, device=DEVICE) * 3).to(torch.bfloat16)
    values = qkv[:, heads + kv_heads:].clone()
    cos, sin = torch.randn(tokens, dim, device=DEVICE), torch.randn(tokens, dim, device=DEVICE)
    slot = torch.arange(tokens, dtype=torch.int32, device=DEVICE) // 32
    offset = torch.arange(tokens, dtype=torch.int32, device=DEVICE) % 32
    rope_write(qkv, cos, sin, k_cache, v_cache, slot, offset, heads, kv_heads, inverse_scale(scale_k),
               inverse_scale(scale_v))
    want_k = quantize_fp8(qkv[:, heads:heads + kv_heads], torch.tensor(inverse_scale(scale_k), device=DEVICE))
    want_v = quantize_fp8(values, torch.tensor(inverse_scale(scale_v), device=DEVICE))
    assert torch.equal(k_cache[:2].view(torch.uint8).reshape(tokens, kv_heads, dim), want_k.view(torch.uint8))
    assert torch.equal(v_cache[:2].view(torch.uint8).reshape(tokens, kv_heads, dim), want_v.view(torch.uint8))


def test_a_pool_sized_from_free_memory_holds_twice_the_fp8_tokens():
    spec = load_spec(resolve_model("builtin:tiny-llama"))

    def tokens(dtype: str) -> int:
        config = KvCacheConfig(tokens_per_block=32, free_gpu_memory_fraction=0.01, dtype=dtype)
        return primary_tokens(config, kv_cache_layout(config, spec, 4096, torch.bfloat16, DEVICE))

    bf16, fp8 = tokens("auto"), tokens("fp8")  # nothing allocated in between: the same free memory
    assert 1.99 <= fp8 / bf16 <= 2.01, (fp8, bf16)
