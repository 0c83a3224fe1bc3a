"""DeepSeek-V2/V3's multi-head latent attention (builtin:tiny-deepseek-v2, -v3): the KV cache is the
latent (kv_lora_rank + qk_rope_head_dim values a token a layer) in the pool, the host tier and on
the wire, never expanded K/V; the pair through a real KV sender and receiver on loopback equals
transformers' generate token for token, also when the context server's blocks went to its host
tier and came back, from a disk tier after a restart, and with an FP8 latent; config options pdserve
does not implement are refused at load, naming the key."""

from __future__ import annotations

import json
import re
import shutil

import engine_harness as eh
import hf_reference
import pytest
import torch
from prompts import random_prompt
from waiting import wait_until

from kvcache import KvCacheConfig
from kvcache.config import DiskTierConfig
from kvcache.kv_scales import as_float32, write_scales
from server.models.builtin import resolve_model
from server.models.calibrate_kv import calibrate
from server.models.kv_format import kv_cache_layout
from server.models.model_spec import load_spec

V2, V3 = "builtin:tiny-deepseek-v2", "builtin:tiny-deepseek-v3"
TPB, LAYERS, LATENT = 16, 4, 32 + 16  # tiny: kv_lora_rank 32 + qk_rope_head_dim 16, 4 heads of 16 + 16 / 24
PROMPTS = [random_prompt(800 + i, n) for i, n in enumerate([40, 71, 33])]  # full and partial blocks


def _expected(model: str, prompt: list[int], n: int) -> list[int]:
    return hf_reference.hf_greedy(resolve_model(model), prompt, n)


def test_the_pool_holds_the_latent_not_expanded_kv():
    spec = load_spec(resolve_model(V3))
    layout = kv_cache_layout(KvCacheConfig(), spec, 256, torch.float32, "cpu")
    fmt = layout.format
    assert (fmt.layout, fmt.planes, fmt.num_kv_heads, fmt.head_dim) == ("latent", 1, 1, LATENT)
    assert fmt.id == f"latent:float32:1x{LATENT}" and fmt.hash_namespace == "latent:float32"
    expanded = spec.num_heads * (spec.mla.qk_head_dim + spec.mla.v_head_dim)  # K and V of every head
    assert layout.bytes_per_token() == LAYERS * LATENT * 4 < LAYERS * expanded * 4
    core = eh.make_core(V3, kv=KvCacheConfig(tokens_per_block=TPB, max_tokens=64 * TPB))
    pool = core.kv.pool(core.kv.window_sizes[0])
    assert tuple(pool.shape) == (64, LAYERS, 1, TPB, 1, LATENT)
    assert core.kv.slot_bytes(core.kv.window_sizes[0]) == TPB * LAYERS * LATENT * 4


def test_the_pair_moves_the_latent_and_is_exact():
    with eh.loopback_pair(V2) as run:
        gens = run.serve(PROMPTS, eh.greedy(12))
        for prompt, rid in zip(PROMPTS, gens, strict=True):
            assert run.tokens(rid) == _expected(V2, prompt, 12)
        wait_until(lambda: run.sender.num_leases == 0, 30, "the leases to end", step=run.step)
        blocks = sum(-(-len(p) // TPB) for p in PROMPTS)  # every block of each prompt, the partial one too
        assert run.sender.stats.bytes_sent == blocks * TPB * LAYERS * LATENT * 4  # the latent, 4 bytes a value
        run.settle()


def test_the_pair_is_exact_when_the_context_server_onboards_a_prefix_from_its_host_tier():
    """The context server's pool holds 6 blocks: the first prompt's blocks go to its host tier while
    the next ones prefill, and its longer version finds them there (prefix reuse, onboarded)."""
    small = KvCacheConfig(tokens_per_block=TPB, max_tokens=6 * TPB, host_cache_size=64 * TPB * LAYERS * LATENT * 4,
                          secondary_offload_min_priority=0)
    prompts = [*PROMPTS, PROMPTS[0] + random_prompt(9, 20)]
    with eh.loopback_pair(V3, ctx={"kv": small}) as run:
        for prompt in prompts:
            [rid] = run.serve([prompt], eh.greedy(12))
            assert run.tokens(rid) == _expected(V3, prompt, 12)
            wait_until(lambda: run.sender.num_leases == 0, 30, "the lease to end", step=run.step)
        stats = run.ctx.kv.stats()
        assert stats.offloads > 0 and stats.onboards > 0
        run.settle()


def test_a_latent_and_a_heads_server_are_refused_at_the_handshake():
    from kv_factories import make_manager

    from transceiver.wire import layout_mismatch, layout_of

    latent = eh.make_core(V2).kv
    heads = make_manager("cpu", tpb=TPB, windows=(512,) * LAYERS, max_seq_len=512, heads=1, dim=LATENT)
    a = layout_of(latent, {w: latent.pool(w) for w in latent.window_sizes}, "fp")
    b = layout_of(heads, {w: heads.pool(w) for w in heads.window_sizes}, "fp")
    assert "kv_layout differs: context 'latent' vs generation 'heads'" in layout_mismatch(a, b)


@pytest.mark.parametrize(("key", "value", "why"), [
    ("ep_size", 2, "expert parallelism"), ("topk_method", "noaux_tc", "supported for this architecture: ['greedy'"),
    ("scoring_func", "sigmoid", "softmax"), ("attention_bias", True, "biases"), ("moe_layer_freq", 2, "only 1"),
])
def test_unsupported_deepseek_options_are_refused_naming_the_key(tmp_path, key, value, why):
    model = tmp_path / "model"
    shutil.copytree(resolve_model(V2), model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, key: value}))
    with pytest.raises(ValueError, match=re.escape(f"config.json: {key}: {value!r}: ") + f".*{re.escape(why)}"):
        load_spec(model)


def test_an_fp8_latent_through_the_pair_equals_the_fp8_aggregated_server_at_a_quarter_of_the_bytes(tmp_path):
    """Scales calibrated on the latent (`pdserve calibrate-kv`: one a layer); the pair moves the
    FP8 latent as it is (one byte a value) and gives the aggregated FP8 server's tokens."""
    k, v = calibrate(resolve_model(V3), random_prompt(1, 300), seq_len=150, device=torch.device("cpu"),
                     dtype=torch.float32)
    assert k == v
    write_scales(tmp_path / "scales.json", k, v)
    fp8 = KvCacheConfig(tokens_per_block=TPB, max_tokens=4096, dtype="fp8", scales=str(tmp_path / "scales.json"))
    fmt = kv_cache_layout(fp8, load_spec(resolve_model(V3)), 256, torch.float32, "cpu").format
    assert (fmt.dtype, fmt.k_scales, fmt.v_scales) == (torch.float8_e4m3fn, tuple(as_float32(x) for x in k), ())
    aggregated = eh.generate(eh.make_core(V3, kv=fp8), PROMPTS, eh.greedy(12))
    with eh.loopback_pair(V3, kv=fp8) as run:
        gens = run.serve(PROMPTS, eh.greedy(12))
        assert [run.tokens(g) for g in gens] == [r.token_ids for r in aggregated]
        wait_until(lambda: run.sender.num_leases == 0, 30, "the leases to end", step=run.step)
        blocks = sum(-(-len(p) // TPB) for p in PROMPTS)
        assert run.sender.stats.bytes_sent == blocks * TPB * LAYERS * LATENT  # one byte a value
        assert run.gen.kv.pool(run.gen.kv.window_sizes[0]).dtype == torch.float8_e4m3fn
        run.settle()


def test_a_restarted_engine_finds_the_latent_on_its_disk_tier(tmp_path):
    """Blocks go primary -> host -> disk files while prompts pass one by one; a new engine on the
    same directory restores them and serves the first prompt's prefix from disk, exact."""
    block = TPB * LAYERS * LATENT * 4
    disk = DiskTierConfig(path=str(tmp_path / "kv"), max_bytes=64 * block)
    kv = KvCacheConfig(tokens_per_block=TPB, max_tokens=6 * TPB, host_cache_size=2 * block, disk=disk,
                       secondary_offload_min_priority=0)
    first = eh.make_core(V3, kv=kv)
    for prompt in [*PROMPTS, *(random_prompt(810 + i, 70) for i in range(3))]:  # pushes the first to disk
        assert eh.generate(first, [prompt], eh.greedy(6))[0].token_ids == _expected(V3, prompt, 6)
    assert first.kv.stats().disk_offloads > 0
    first.kv.close()
    again = eh.make_core(V3, kv=kv)
    [result] = eh.generate(again, [PROMPTS[0]], eh.greedy(6))
    assert result.token_ids == _expected(V3, PROMPTS[0], 6)
    assert result.final.cached_tokens == 32 and again.kv.stats().disk_onboards == 2  # its 2 full blocks
    again.kv.close()
