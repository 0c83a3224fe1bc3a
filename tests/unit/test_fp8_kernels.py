"""The FP8 GEMM path of the GPU, its logic on the CPU: the Triton kernels through Triton's interpreter
(TRITON_INTERPRET=1) against the plain torch reference (`weight.w8a8_linear`), cuBLAS's two paths
through torch's CPU `_scaled_mm`, the choice of path per shape and row count, and a whole runner on
the Triton path with FP8 weights, each of its FP8 linears against the exact value of its input's GEMM; and
every kernel variant compiled for a Hopper GPU by Triton's own compiler (no GPU needed).

On the GPU, tests/gpu/test_fp8_cuda.py runs them.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from prompts import random_prompt

pytest.importorskip("triton", reason="the Triton kernels need the triton package (test extra)")
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CUDA machine: the kernels compile there (tests/gpu covers them)")

from kvcache import KvCacheConfig, KVCacheManager  # noqa: E402
from server.models.builtin import resolve_model  # noqa: E402
from server.models.fp8 import linear as L  # noqa: E402
from server.models.fp8.weight import (  # noqa: E402
    FP8,
    Fp8Weight,
    dequantized_linear,
    quantize_rows,
    quantize_weight,
    scaled_output,
    w8a8_linear,
)
from server.models.kernels import fp8 as K  # noqa: E402
from server.models.model_spec import load_spec  # noqa: E402
from server.models.runner import ModelRunner, SeqChunk  # noqa: E402

GRID = torch.arange(256, dtype=torch.uint8).view(FP8).float()
GRID = GRID[~GRID.isnan()].unique()  # every finite e4m3 value, sorted


@interpreted
@pytest.mark.parametrize("static", [None, torch.tensor([0.03])])
def test_quantize_rows_equals_torch_rounding(static) -> None:
    torch.manual_seed(0)
    x = torch.randn(6, 1500) * torch.tensor([1e-4, 1, 300, 0, 3, 1e3])[:, None]  # K spans two blocks
    xq, xs = K.quantize_rows(x, static)
    want_q, want_s = quantize_rows(x, static)
    assert xq.dtype == FP8 and torch.equal(xs, want_s)
    assert torch.equal(xq.float(), want_q.float())  # (equal as values: -0.0 == 0.0)


@interpreted
def test_quantize_rows_rounds_to_nearest_even_like_torch() -> None:
    """Every e4m3 value stays itself; every midpoint between two neighbours rounds to the even one, as
    torch's cast does; values just off a midpoint go to the nearer one."""
    mids = (GRID[1:] + GRID[:-1]) / 2
    for row in (GRID, mids, mids * (1 + 2**-20), mids * (1 - 2**-20), -mids):
        x = torch.cat([row, torch.tensor([448.0])])[None, :]  # the 448 keeps the row's scale at 1
        xq, xs = K.quantize_rows(x)
        assert xs.item() == 1.0
        assert torch.equal(xq.float(), x.to(FP8).float())


@interpreted
@pytest.mark.parametrize("config", [L.CONFIGS[16][0], L.CONFIGS[16][3], L.CONFIGS[16][4], L.CONFIGS[32][1],
                                    L.CONFIGS[64][0]])
@pytest.mark.parametrize("rows", [1, 5, 16, 33, 64, 70])
def test_fp8_gemm_matches_the_reference(config, rows: int) -> None:
    """N and K off every block size (masks), a bias, rows past one row tile (70), configs that quantize
    their input themselves (dynamic and static scales) and configs that take it quantized; float32
    out: equal to the reference up to the order of the float32 sums."""
    torch.manual_seed(rows)
    x, w, bias = torch.randn(rows, 200), quantize_weight(torch.randn(90, 200)), torch.randn(90)
    static = torch.tensor([0.01])
    for b in (bias, None):
        for scale in (None, static):
            want = w8a8_linear(x, Fp8Weight(w.qweight, w.scale, scale), b)
            if config[-1]:
                got = K.fp8_gemm(x, None, w.qweight, w.scale, b, torch.float32, config, scale)
            else:
                xq, xs = K.quantize_rows(x, scale)
                got = K.fp8_gemm(xq, xs, w.qweight, w.scale, b, torch.float32, config)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@interpreted
@pytest.mark.parametrize("config", L.GEMV_CONFIGS[:3])
def test_fp8_gemv_is_the_dequantized_product(config) -> None:
    """The weight-only GEMV: N and K off its block sizes (masks), with and without a bias, one row and three
    (each row streams the weight); equal to x times the dequantized weight up to the order of float32 sums,
    and the path's own error check (its reference the dequantized product, not the quantized rows') passes."""
    torch.manual_seed(config.block_n)
    w, bias = quantize_weight(torch.randn(90, 600)), torch.randn(90)
    for rows in (1, 3):
        x = torch.randn(rows, 600)
        for b in (bias, None):
            got = K.fp8_gemv(x, w.qweight, w.scale, b, config)
            torch.testing.assert_close(got, dequantized_linear(x, w, b), rtol=1e-5, atol=1e-5)
    linears = L.Fp8Linears()
    assert linears._error(config, torch.randn(1, 600), w, bias) < 1e-6
    assert linears._error(L.CONFIGS[16][0], torch.randn(1, 600), w, bias) < 1e-6  # W8A8 against its own reference


@interpreted
def test_scale_epilogue_equals_the_reference() -> None:
    torch.manual_seed(1)
    acc, xs, ws, bias = torch.randn(7, 300) * 1e4, torch.rand(7), torch.rand(300), torch.randn(300)
    assert torch.equal(K.scale_out(acc, xs, ws, bias, torch.float32), scaled_output(acc, xs, ws, bias, torch.float32))
    assert torch.equal(K.scale_out(acc, xs, ws, None, torch.float32), scaled_output(acc, xs, ws, None, torch.float32))


@interpreted
@pytest.mark.parametrize("path", [L.CUBLAS_UNIT, L.CUBLAS_ROWWISE, L.TORCH, L.CONFIGS[16][1], L.CONFIGS[16][4]])
def test_every_gemm_path_computes_the_reference(path) -> None:
    """cuBLAS's paths run through torch's CPU `_scaled_mm` here (the same call as on the GPU)."""
    torch.manual_seed(2)
    dtype = torch.bfloat16 if path == L.CUBLAS_ROWWISE else torch.float32  # row-wise scales: bf16 out only
    x, w, bias = torch.randn(9, 128, dtype=dtype), quantize_weight(torch.randn(64, 128)), torch.randn(64, dtype=dtype)
    got, want = L.Fp8Linears().run(path, x, w, bias), w8a8_linear(x, w, bias)
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_path_candidates_and_choice() -> None:
    assert [L.row_class(m) for m in (1, 2, 8, 9, 16, 24, 33, 64, 65, 4096)] == [1, 8, 8, 16, 16, 32, 64, 64, 256, 256]
    bf16 = torch.bfloat16
    assert L.candidates(1, 4096, 4096, bf16) == [L.CUBLAS_UNIT, L.CUBLAS_ROWWISE, *L.CONFIGS[16], *L.GEMV_CONFIGS]
    assert L.candidates(2, 4096, 4096, bf16) == [L.CUBLAS_UNIT, L.CUBLAS_ROWWISE, *L.CONFIGS[16]]  # GEMV: one row
    assert L.candidates(48, 4096, 4096, torch.float16) == [L.CUBLAS_UNIT, *L.CONFIGS[64]]
    assert L.candidates(256, 4096, 4096, bf16) == [L.CUBLAS_UNIT, L.CUBLAS_ROWWISE]  # prefill: cuBLAS only
    assert L.candidates(1, 4096, 4096, bf16, ours=False) == [L.CUBLAS_UNIT, L.CUBLAS_ROWWISE]
    assert L.candidates(1, 100, 4096, bf16) == [*L.CONFIGS[16], *L.GEMV_CONFIGS]  # N not a multiple of 16: no cuBLAS
    assert L._name(L.GEMV_CONFIGS[0]) == "gemv_8x512_w4"
    assert L.candidates(256, 100, 4096, bf16) == [L.TORCH]
    ours = L.CONFIGS[16][2]
    paths = [L.CUBLAS_UNIT, L.CUBLAS_ROWWISE, ours]
    assert L._fastest(paths, {"cublas_unit": 1.0, "cublas_rowwise": 2.0, L._name(ours): 0.97}) == ours
    assert L._fastest(paths, {"cublas_unit": 1.0, "cublas_rowwise": 2.0, L._name(ours): 0.99}) == L.CUBLAS_UNIT
    assert L._fastest(paths, {"cublas_rowwise": 2.0}) == L.CUBLAS_ROWWISE  # the unit path failed here
    assert L._fastest([ours], {L._name(ours): 5.0}) == ours
    assert L._fastest(paths, {}) == L.TORCH


@interpreted
def test_triton_runner_with_fp8_weights_computes_the_gpu_numerics() -> None:
    """The whole runner on the Triton path (interpreted) with `quantization: fp8`, a prefill and two decode
    steps: every FP8 linear it runs returns what the GPU's FP8 GEMM computes from the input that linear was
    given (`fp8_reference`), within the float32 rounding bound of that GEMM.

    Each linear is checked against its own input, not against a second model run beside it (the torch
    emulation, `W8A8TorchOps`): that model computes attention and the norms in other float32 orders, which
    differ in the last bits from CPU to CPU (oneDNN picks its kernels by the CPU's features: AMX and
    AVX-512 FP16 among them), and an activation one bit off a rounding midpoint goes to the neighbouring
    FP8 value, a step of 6-12%: on such CPUs the two models' logits differed by up to 0.05."""
    model_dir = resolve_model("builtin:tiny-llama")
    kv = KVCacheManager(KvCacheConfig(max_tokens=1024, tokens_per_block=16),
                        load_spec(model_dir).cache_layout(256, torch.float32, "cpu"))
    runner = ModelRunner(model_dir, kv, dtype=torch.float32, device=torch.device("cpu"), max_num_tokens=128,
                         max_batch_size=2, kernels="triton", cuda_graphs=False, quantization="fp8")
    calls = []
    linear = runner.model.ops.linear

    def recorded(x: torch.Tensor, weight, bias: torch.Tensor | None) -> torch.Tensor:
        out = linear(x, weight, bias)
        if isinstance(weight, Fp8Weight):
            calls.append((x.clone(), weight, bias, out.clone()))
        return out

    runner.model.ops.linear = recorded
    prompt = random_prompt(5, 30)
    tables = {w: list(range(4)) for w in kv.window_sizes}
    logits = runner.execute([SeqChunk(prompt, 0, tables, True, num_logits=len(prompt))])
    tokens = [int(logits[-1].argmax())]
    # two decode steps, each feeding back the token the step before chose: their linears run on one row, as
    # every decode step's do (the prefill's on 30); more steps would repeat these shapes under the
    # interpreter (~1.7 s each)
    for i in range(2):
        tokens.append(int(runner.execute([SeqChunk([tokens[-1]], len(prompt) + i, tables, True)])[0].argmax()))
    assert len(calls) == 3 * 4 * runner.spec.num_layers  # qkv, o, gate_up, down per layer and step
    assert [x.shape[0] for x, *_ in calls[::4 * runner.spec.num_layers]] == [len(prompt), 1, 1]
    for x, weight, bias, out in calls:
        want, bound = fp8_reference(x, weight, bias)
        assert out.dtype == torch.float32
        assert ((out.double() - want).abs() <= bound).all(), float(((out.double() - want).abs() / bound).max())


def fp8_reference(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """What the GPU's FP8 linear computes from x [M, K] (exactly, in float64) and how far a float32 result
    may be from it: ([M, N] value, [M, N] bound).

    The activations are rounded to FP8 per token by `quantize_rows` (float32 elementwise operations, the
    kernel's to the bit: test_quantize_rows_equals_torch_rounding). A product of two e4m3 values has at most
    8 significant bits, so float32 holds each exactly; the GEMM sums K of them in float32, in an order of
    its own: whatever the order, that sum is within (K - 1) u sum_k |xq wq| of the exact one (u = 2^-24,
    float32's unit roundoff). The epilogue's two products, the bias and the output add a rounding each.
    (K + 4) u covers all of them, with the second-order terms (K u < 1e-3 here)."""
    xq, xs = quantize_rows(x, w.input_scale)
    xq, wq = xq.double(), w.qweight.double()
    scales = xs.double()[:, None] * w.scale.double()[None, :]
    b = torch.zeros(w.shape[0], dtype=torch.float64) if bias is None else bias.double()
    want = (xq @ wq.t()) * scales + b
    bound = (x.shape[1] + 4) * 2.0**-24 * ((xq.abs() @ wq.abs().t()) * scales + b.abs())
    return want, bound


def test_every_fp8_kernel_variant_compiles_for_hopper() -> None:
    """The GPU's own compile of every FP8 kernel variant the warm-up may run (tests/hopper_compile.py), for
    sm_90, with no GPU: wgmma where the tile allows it, loads pipelined (cp.async), shared memory within
    the H200's 227 KiB."""
    pytest.importorskip("triton.backends.nvidia", reason="the Triton wheel without its NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    tests = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join([str(tests.parent), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, str(tests / "hopper_compile.py")], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("_fp8_gemm")]
    quant = sum(c[-1] for configs in L.CONFIGS.values() for c in configs)
    assert len(lines) == sum(len(c) for c in L.CONFIGS.values()) + quant  # quantizing ones: also static
    results = [ast.literal_eval(line[line.rindex("{'shared'"):]) for line in lines]
    assert all(r["pipelined"] and r["shared"] <= 227 * 1024 for r in results), done.stdout
    assert any(r["wgmma"] for r in results), done.stdout
    from server.models.kernels.moe import CANDIDATES

    tiles = len({t for candidates in CANDIDATES.values() for t in candidates})
    moe = [line for line in done.stdout.splitlines() if line.startswith(("_gate_up_silu", "_down_weighted"))]
    # the grouped kernels (kernels/moe.py) for the FP8 experts (W8A8) and with block-scaled float8 weights,
    # at every tile the warm-up may choose; the block-scaled GEMM at 4 row counts
    assert len(moe) == 4 * tiles and sum("'BLOCKED': True" in line for line in moe) == 2 * tiles, done.stdout
    assert sum("'W8A8': True" in line for line in moe) == 2 * tiles, done.stdout
    blocks = [line for line in done.stdout.splitlines() if line.startswith("_fp8_block_gemm")]
    assert len(blocks) == 4, done.stdout
    compiled = [ast.literal_eval(line[line.rindex("{'shared'"):]) for line in moe + blocks]
    assert all(r["pipelined"] and r["shared"] <= 227 * 1024 for r in compiled), done.stdout
    # the decode attention kernels: dense K/V in bf16 and FP8 at 3 keys-per-step choices, the latent
    # cache's split kernel and its row write; rope_write into bf16 and FP8 caches and with a half rotary;
    # MLA's rotary (interleaved and in halves); Qwen3's per-head q and k norms
    decode = [line for line in done.stdout.splitlines() if line.startswith(("_decode_split", "_latent_split",
                                                                             "_write_rows", "_rope_write",
                                                                             "_latent_rope", "_head_rms_norm"))]
    assert len(decode) == 14, done.stdout
    assert sum(line.startswith("_penalise") for line in done.stdout.splitlines()) == 1, done.stdout
    # the one-row weight-only GEMVs (with and without a bias) and a MoE gate's fused top-k at two shapes
    assert sum(line.startswith("_fp8_gemv") for line in done.stdout.splitlines()) == 2 * len(L.GEMV_CONFIGS)
    assert sum(line.startswith("_route") for line in done.stdout.splitlines()) == 2, done.stdout
    assert sum(line.startswith("_align") for line in done.stdout.splitlines()) == 3, done.stdout
    assert all(ast.literal_eval(line[line.rindex("{'shared'"):])["shared"] <= 227 * 1024 for line in decode)
