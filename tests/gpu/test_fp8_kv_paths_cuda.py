"""Every attention path over an FP8 KV cache against the portable path over the same cache (CUDA).

A float32 model with an FP8 cache: the Triton kernels and the torch path read the same e4m3 codes and
scales and compute in float32. A fresh prompt attends over its K/V as read back from the cache here
(PDSERVE_DENSE_PREFILL=triton: the paged prefill kernel), as the torch path does; served, the Triton
path attends a fresh prompt over its unrounded K/V (dense SDPA) instead. One teacher-forced run per
path, each compared step by step with `kernels: torch`:
- eager: a fresh prompt, its second half as a chunk after a cached first half (the paged prefill
  kernel), then decode steps with split-K (`decode_splits` > 1 for so few rows);
- graphs: the same, the decode steps replayed from CUDA graphs (and short chunks as decode rows).
`fp8_paths_logits` runs on the CPU too (Triton's interpreter, graphs off), where the two paths agreed within 0.033.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvcache import KvCacheConfig, KVCacheManager
from kvcache.kv_scales import write_scales
from server.models.builtin import resolve_model
from server.models.calibrate_kv import calibrate
from server.models.kernels.attention import decode_splits
from server.models.kv_format import kv_cache_layout
from server.models.model_spec import load_spec
from server.models.runner import ModelRunner, SeqChunk

MODEL = "builtin:tiny-llama"
ROWS, FIRST, SECOND, STEPS = 3, 40, 24, 12
# Two float32 summation orders round an activation's last bit apart now and then, which can move one
# K or V value to the neighbouring e4m3 code (a 6-12% step) in a later layer: measured on the CPU
# (Triton's interpreter) at most 0.033 of logits spanning +-5. Storing FP8 at all moves them by 0.5-1.0,
# and a misread code or scale by as much or more.
TOLERANCE = 0.1


def _scales(model_dir, device: torch.device, path) -> str:
    ids = random.Random(1).choices(range(8, 400), k=512)
    k, v = calibrate(model_dir, ids, seq_len=256, device=device, dtype=torch.float32)
    write_scales(path, k, v)
    return str(path)


def _runner(model_dir, scales: str, device: torch.device, kernels: str, graphs: bool) -> ModelRunner:
    config = KvCacheConfig(tokens_per_block=16, max_tokens=ROWS * 256, dtype="fp8", scales=scales)
    layout = kv_cache_layout(config, load_spec(model_dir), 256, torch.float32, device)
    runner = ModelRunner(model_dir, KVCacheManager(config, layout), dtype=torch.float32, device=device,
                         max_num_tokens=256, max_batch_size=8, kernels=kernels, cuda_graphs=graphs, max_seq_len=256)
    runner.warm_up()
    return runner


def _teacher_forced(runner: ModelRunner, seqs: list[list[int]]) -> list[torch.Tensor]:
    """Logits of: the first halves (fresh prompts), the second halves (chunks after a cached prefix),
    then STEPS decode steps, each input the sequences' own next token."""
    kv = runner.kv
    for i, s in enumerate(seqs):
        kv.admit(f"r{i}", s)
    tables = [{w: kv.slot_table(f"r{i}", w) for w in kv.window_sizes} for i in range(len(seqs))]
    def step(chunks: list[SeqChunk]) -> torch.Tensor:  # a replay's logits live in its graph's buffer: copy now
        return runner.execute(chunks).float().cpu()

    out = [step([SeqChunk(s[:FIRST], 0, t, True) for s, t in zip(seqs, tables, strict=True)]),
           step([SeqChunk(s[FIRST:FIRST + SECOND], FIRST, t, True) for s, t in zip(seqs, tables, strict=True)])]
    for i in range(STEPS):
        at = FIRST + SECOND + i
        out.append(step([SeqChunk([s[at]], at, t, True) for s, t in zip(seqs, tables, strict=True)]))
    return out


def fp8_paths_logits(device: torch.device, tmp_path, graphs: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Needs PDSERVE_DENSE_PREFILL=triton in the environment (see above)."""
    """(torch path's logits, Triton path's logits) per step, same FP8 cache and inputs."""
    model_dir = resolve_model(MODEL)
    scales = _scales(model_dir, device, tmp_path / "scales.json")
    rng = random.Random(7)
    seqs = [rng.choices(range(8, 400), k=FIRST + SECOND + STEPS) for _ in range(ROWS)]
    reference = _teacher_forced(_runner(model_dir, scales, device, "torch", False), seqs)
    triton_runner = _runner(model_dir, scales, device, "triton", graphs)
    assert triton_runner.kv.layer_cache(0)[0].dtype == torch.float8_e4m3fn
    attention = triton_runner.attention
    assert decode_splits(ROWS, attention.num_kv_heads, attention.num_sms) > 1  # the decode steps use split-K
    return reference, _teacher_forced(triton_runner, seqs)


def assert_paths_agree(reference: list[torch.Tensor], got: list[torch.Tensor]) -> None:
    names = ["fresh prompt", "chunk after a cached prefix"] + [f"decode {i}" for i in range(STEPS)]
    worst = {name: (g - r).abs().max().item() for name, g, r in zip(names, got, reference, strict=True)}
    print("max |triton - torch| per step:", {k: round(v, 6) for k, v in worst.items()})
    bad = {k: v for k, v in worst.items() if v > TOLERANCE}
    assert not bad, f"FP8 cache: the Triton path parts from the torch path at {bad}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_every_attention_path_over_an_fp8_cache_equals_the_torch_path(tmp_path, graphs, monkeypatch):
    monkeypatch.setenv("PDSERVE_DENSE_PREFILL", "triton")
    reference, got = fp8_paths_logits(torch.device("cuda"), tmp_path, graphs)
    assert_paths_agree(reference, got)
