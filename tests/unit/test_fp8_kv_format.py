"""Where an FP8 cache's scales come from and who checks them: the checkpoint's k/v scales under the
names FP8 checkpoints use, `pdserve calibrate-kv` (largest |K|, |V| per layer over 448, equal to what
transformers' own cache holds), a deployment whose context and generation servers differ in KV
dtype or scales (refused at load and by `pdserve launch`, naming both), and the KV events (the
snapshot and every batch name the KV dtype)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch
import yaml
from kv_factories import make_manager
from prompts import random_prompt
from safetensors.torch import save_file
from transformers import AutoTokenizer

from kvcache import KvCacheConfig
from kvcache.kv_scales import FP8_MAX, as_float32, read_scales, write_scales
from server.cli import main as cli_main
from server.config.schema import ConfigError, load_deployment
from server.models.builtin import resolve_model
from server.models.calibrate_kv import calibrate
from server.models.kv_format import checkpoint_scales, kv_cache_layout
from server.models.model_spec import load_spec
from server.router.kv_feed import KvFeed
from server.telemetry.kv_events import KvEventBatch, KvEventSource, message_batches

ROOT = Path(__file__).resolve().parents[2]
LLAMA = "builtin:tiny-llama"
LAYERS = 4


@pytest.fixture
def model_copy(tmp_path):
    """tiny-llama's directory, copied, to add scale tensors to."""
    out = tmp_path / "model"
    shutil.copytree(resolve_model(LLAMA), out)
    return out


@pytest.mark.parametrize("k_name, v_name, shape", [
    ("self_attn.k_scale", "self_attn.v_scale", ()),  # compressed-tensors (llm-compressor), vLLM
    ("self_attn.k_proj.k_scale", "self_attn.v_proj.v_scale", (1,)),  # NVIDIA ModelOpt
    ("self_attn.k_proj.output_scale", "self_attn.v_proj.output_scale", ()),  # AutoFP8
])
def test_the_checkpoints_scales_are_read_under_each_tools_names(model_copy, k_name, v_name, shape):
    tensors = {}
    for i in range(LAYERS):
        tensors[f"model.layers.{i}.{k_name}"] = torch.full(shape, 0.01 * (i + 1))
        tensors[f"model.layers.{i}.{v_name}"] = torch.full(shape, 0.5 / (i + 1))
    save_file(tensors, model_copy / "kv_scales.safetensors")
    k, v = checkpoint_scales(model_copy, LAYERS)
    assert k == tuple(as_float32(0.01 * (i + 1)) for i in range(LAYERS))
    assert v == tuple(as_float32(0.5 / (i + 1)) for i in range(LAYERS))
    lay = kv_cache_layout(KvCacheConfig(dtype="fp8"), load_spec(model_copy), 64, torch.float32, "cpu")
    assert (lay.format.dtype, lay.format.k_scales, lay.format.v_scales) == (torch.float8_e4m3fn, k, v)


def test_one_kv_scale_serves_both_a_per_head_scale_its_largest_and_a_file_comes_first(model_copy, tmp_path):
    save_file({f"model.layers.{i}.self_attn.kv_scale": torch.tensor([0.25, 0.5]) for i in range(LAYERS)},
              model_copy / "kv_scales.safetensors")
    assert checkpoint_scales(model_copy, LAYERS) == ((0.5,) * LAYERS, (0.5,) * LAYERS)
    path = tmp_path / "scales.json"
    write_scales(path, [2.0] * LAYERS, [3.0] * LAYERS)
    lay = kv_cache_layout(KvCacheConfig(dtype="fp8", scales=str(path)), load_spec(model_copy), 64, torch.float32,
                          "cpu")
    assert (lay.format.k_scales, lay.format.v_scales) == ((2.0,) * LAYERS, (3.0,) * LAYERS)
    bare = kv_cache_layout(KvCacheConfig(dtype="fp8"), load_spec(resolve_model(LLAMA)), 64, torch.float32, "cpu")
    assert bare.format.k_scales == (1.0,) * LAYERS  # none anywhere: 1.0
    plain = kv_cache_layout(KvCacheConfig(), load_spec(model_copy), 64, torch.float32, "cpu")
    assert plain.format.dtype == torch.float32


def test_scales_for_some_layers_only_are_refused(model_copy):
    save_file({f"model.layers.{i}.self_attn.{n}": torch.tensor(0.1) for i in (0, 2) for n in ("k_scale", "v_scale")},
              model_copy / "kv_scales.safetensors")
    with pytest.raises(ValueError, match=r"none for layers \[1, 3\]"):
        checkpoint_scales(model_copy, LAYERS)


def test_calibration_is_the_largest_k_and_v_transformers_caches_over_448(tmp_path):
    model_dir = resolve_model(LLAMA)
    ids = random_prompt(5, 300)
    k, v = calibrate(model_dir, ids, seq_len=128, device=torch.device("cpu"), dtype=torch.float32)
    from hf_reference import hf_model

    model = hf_model(model_dir)
    k_max, v_max = torch.zeros(LAYERS), torch.zeros(LAYERS)
    for start in range(0, len(ids), 128):  # the same windows, each from an empty cache
        with torch.inference_mode():
            cache = model(torch.tensor([ids[start:start + 128]]), use_cache=True).past_key_values
        for i, layer in enumerate(cache.layers):
            k_max[i] = max(k_max[i], layer.keys.abs().max())
            v_max[i] = max(v_max[i], layer.values.abs().max())
    torch.testing.assert_close(torch.tensor(k), k_max / FP8_MAX, rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(v), v_max / FP8_MAX, rtol=1e-5, atol=0)
    text = tmp_path / "sample.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    out = tmp_path / "scales.json"
    assert cli_main(["calibrate-kv", LLAMA, "--out", str(out), "--text", str(text), "--seq-len", "64"]) == 0
    sample = AutoTokenizer.from_pretrained(model_dir).encode(text.read_text())
    expected = calibrate(model_dir, sample, seq_len=64, device=torch.device("cpu"), dtype=torch.float32)
    assert read_scales(out, LAYERS) == tuple(tuple(as_float32(s) for s in part) for part in expected)
    assert msgspec.json.decode(out.read_bytes())["tokens"] == len(sample)


def _deployment(tmp_path, ctx: dict, gen: dict) -> str:
    cfg = yaml.safe_load((ROOT / "configs" / "disagg_host_offload.yaml").read_text())
    cfg["context_servers"]["kv_cache_config"].update(ctx)
    cfg["generation_servers"]["kv_cache_config"].update(gen)
    path = tmp_path / "deployment.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_a_pair_of_other_kv_dtypes_or_scales_is_refused_at_load_naming_both(tmp_path):
    a, b, same = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "same-as-a.json"
    write_scales(a, [0.1] * 4, [0.2] * 4)
    write_scales(b, [0.1] * 4, [0.3] * 4)
    write_scales(same, [0.1] * 4, [0.2] * 4)
    cases = [
        ({"dtype": "fp8"}, {}, "kv_cache_config.dtype differs: context server 127.0.0.1:8001 has 'fp8', "
                               "generation server 127.0.0.1:8002 has 'auto'"),
        ({"dtype": "fp8", "scales": str(a)}, {"dtype": "fp8"},
         f"kv_cache_config.scales differ: context server 127.0.0.1:8001 {str(a)!r}, generation server "
         "127.0.0.1:8002 the checkpoint's (or 1.0)"),
        ({"dtype": "fp8", "scales": str(a)}, {"dtype": "fp8", "scales": str(b)},
         f"kv_cache_config.scales differ: context server 127.0.0.1:8001 has {str(a)!r}, generation server "
         f"127.0.0.1:8002 has {str(b)!r}, of other values"),
    ]
    for ctx, gen, message in cases:
        with pytest.raises(ConfigError) as refused:
            load_deployment(_deployment(tmp_path, ctx, gen))
        assert message in str(refused.value)
    equal = {"dtype": "fp8", "scales": str(same)}  # another file of the same values
    ok = load_deployment(_deployment(tmp_path, {"dtype": "fp8", "scales": str(a)}, equal))
    assert [s.kv_cache_config.dtype for s in ok.servers] == ["fp8", "fp8"]
    path = _deployment(tmp_path, {"dtype": "fp8"}, {})
    launch = subprocess.run([sys.executable, "-m", "server.cli", "launch", path], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert launch.returncode == 2 and "kv_cache_config.dtype differs: context server" in launch.stderr
    assert "started" not in launch.stdout + launch.stderr  # refused before any process started


def test_kv_events_name_the_kv_dtype_and_another_dtype_means_a_resync():
    m = make_manager("cpu", dtype=torch.float8_e4m3fn)
    source = KvEventSource(None, "epoch-1")

    class Core:
        kv = m

    future = source.request_snapshot()
    source.on_tick(Core())  # the engine thread's tick answers it
    snapshot = future.result(timeout=0)
    assert snapshot["kv_dtype"] == "float8_e4m3fn" and snapshot["salt"] == m.salt
    assert [b.kv_dtype for b in message_batches(1, [(64, 0, b"h" * 16, 0)], "float8_e4m3fn")] == ["float8_e4m3fn"]
    feed = KvFeed()
    feed.subscribed()
    assert feed.on_batch("e", KvEventBatch(1, [], "float8_e4m3fn"))
    assert not feed.on_snapshot({**snapshot, "epoch": "e", "seq": 0})
    assert feed.index.kv_dtype == "float8_e4m3fn"
    assert not feed.on_batch("e", KvEventBatch(1, [], "float8_e4m3fn"))
    assert feed.on_batch("e", KvEventBatch(1, [], "bfloat16")) and feed.resyncs == {"kv_dtype": 1}

