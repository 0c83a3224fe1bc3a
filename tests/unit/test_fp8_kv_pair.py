"""An FP8 KV cache through the pair, in process (real KV sender and receiver on loopback, tiny-llama):
the disaggregated output equals the aggregated server's with the same FP8 cache token for token,
the generation server holds the context server's blocks byte for byte, the transfer moves a quarter
of a float32 cache's bytes, and a pair whose KV dtypes or scales differ is refused at the handshake,
naming both sides' values."""

from __future__ import annotations

import engine_harness as eh
import pytest
import torch
from kv_factories import loopback_link
from prompts import random_prompt
from waiting import wait_until

from kvcache import KvCacheConfig, Level
from kvcache.kv_scales import write_scales
from server.models.builtin import resolve_model
from server.models.calibrate_kv import calibrate

LLAMA = "builtin:tiny-llama"
PROMPTS = [random_prompt(700 + i, n) for i, n in enumerate([40, 71, 33])]  # full and partial blocks
STEPS = 12


@pytest.fixture(scope="module")
def scales(tmp_path_factory) -> str:
    """Scales calibrated on tiny-llama (`pdserve calibrate-kv`'s measurement)."""
    k, v = calibrate(resolve_model(LLAMA), random_prompt(1, 400), seq_len=200, device=torch.device("cpu"),
                     dtype=torch.float32)
    path = tmp_path_factory.mktemp("scales") / "scales.json"
    write_scales(path, k, v)
    return str(path)


def fp8(scales: str) -> KvCacheConfig:
    return KvCacheConfig(tokens_per_block=16, max_tokens=4096, dtype="fp8", scales=scales)


def _disaggregated(kv: KvCacheConfig, quantization: str | None = None) -> tuple[list[list[int]], int, list[bool]]:
    """Each prompt through the pair: its tokens, the bytes the sender sent, and whether the
    generation server's copy of each of its full blocks equals the context server's, byte for byte."""
    with eh.loopback_pair(LLAMA, kv=kv, quantization=quantization) as run:
        gens = run.serve(PROMPTS, eh.greedy(STEPS))
        same = [torch.equal(_block_bytes(run.ctx.kv, p, i), _block_bytes(run.gen.kv, p, i))
                for p in PROMPTS for i in range(len(p) // 16)]
        tokens = [run.tokens(g) for g in gens]  # the first token (the context leg's) included
        wait_until(lambda: run.sender.num_leases == 0, 30, "the leases to end", step=run.step)
        return tokens, run.sender.stats.bytes_sent, same


def _block_bytes(kv, prompt: list[int], index: int) -> torch.Tensor:
    """The bytes of the cached block that holds prompt block `index` (found by its hash)."""
    from kvcache.hashing import block_hashes

    wanted = block_hashes(prompt, 16, kv.salt)[index]
    window = kv.window_sizes[0]
    block = kv._group(window).bm.tree.by_hash[wanted]
    assert block.level is Level.PRIMARY
    return kv.pool(window)[block.slot].view(-1).view(torch.uint8).clone()


def test_fp8_pair_equals_the_fp8_aggregated_server_and_moves_a_quarter_of_float32s_bytes(scales):
    aggregated = eh.generate(eh.make_core(LLAMA, kv=fp8(scales)), PROMPTS, eh.greedy(STEPS))
    tokens, fp8_bytes, same = _disaggregated(fp8(scales))
    assert tokens == [r.token_ids for r in aggregated]
    assert all(same) and len(same) == sum(len(p) // 16 for p in PROMPTS)
    _, fp32_bytes, _ = _disaggregated(KvCacheConfig(tokens_per_block=16, max_tokens=4096))
    blocks = sum(-(-len(p) // 16) for p in PROMPTS)  # every block of each prompt, the partial one too
    slot = 16 * 4 * 2 * 2 * 32  # tokens x layers x (K, V) x kv heads x head_dim: one byte each
    assert (fp8_bytes, fp32_bytes) == (blocks * slot, 4 * blocks * slot)


def test_fp8_weights_and_an_fp8_cache_together_through_the_pair(scales):
    """FP8 weights (quantized at load) with an FP8 KV cache: the pair equals that aggregated server."""
    aggregated = eh.generate(eh.make_core(LLAMA, kv=fp8(scales), quantization="fp8"), PROMPTS, eh.greedy(STEPS))
    tokens, _, same = _disaggregated(fp8(scales), "fp8")
    assert tokens == [r.token_ids for r in aggregated] and all(same)


def _handshake(ctx_kv, gen_kv) -> str:
    with loopback_link(ctx_kv, gen_kv) as (sender, receiver):
        receiver.probe(sender.endpoint)
        wait_until(lambda: receiver.peer_status().get(sender.endpoint, "unchecked") != "unchecked", 10,
                   "the handshake")
        return receiver.peer_status()[sender.endpoint]


def test_a_pair_of_other_kv_dtypes_or_scales_is_refused_at_the_handshake_naming_both(scales, tmp_path):
    fp8_kv = eh.make_core(LLAMA, kv=fp8(scales)).kv
    fp32_kv = eh.make_core(LLAMA).kv
    assert _handshake(fp8_kv, eh.make_core(LLAMA, kv=fp8(scales)).kv) == "compatible"
    status = _handshake(fp8_kv, fp32_kv)
    assert status.startswith("incompatible: ")
    assert "dtype differs: context 'float8_e4m3fn' vs generation 'float32'" in status, status
    other = tmp_path / "other.json"
    write_scales(other, [0.5, 0.25, 0.125, 1.0], [1.0] * 4)
    status = _handshake(fp8_kv, eh.make_core(LLAMA, kv=fp8(str(other))).kv)
    ctx_k = [fp8_kv.layout.format.layer_scales(i)[0] for i in range(4)]
    assert f"k_scales differs: context {ctx_k!r} vs generation [0.5, 0.25, 0.125, 1.0]" in status, status


def test_tensor_parallel_head_cuts_move_fp8_bytes_unchanged():
    """A generation rank that holds other kv heads than the context rank gets its heads cut out of
    each FP8 block and written into its own (torch has no indexed float8 copy on the CPU)."""
    from transceiver.tp import gather_heads, scatter_heads

    g = torch.Generator().manual_seed(7)
    pool = torch.randint(0, 256, (6, 2, 2, 4, 4, 8), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
    out = torch.empty(1 << 16, dtype=torch.uint8)
    n = gather_heads(pool, [4, 1], (1, 3), out)
    assert n == 2 * 2 * 2 * 4 * 2 * 8  # two blocks of 2 layers, K and V, 4 tokens, 2 heads, 8 dims: a byte each
    dst = torch.zeros(6, 2, 2, 4, 2, 8, dtype=torch.float8_e4m3fn)
    scatter_heads(dst, [0, 5], (0, 2), [out[: n // 2].numpy(), out[n // 2: n].numpy()])  # two frames
    raw, got = pool.view(torch.uint8), dst.view(torch.uint8)
    assert torch.equal(got[0], raw[4, :, :, :, 1:3]) and torch.equal(got[5], raw[1, :, :, :, 1:3])
    assert not got[1:5].any()
