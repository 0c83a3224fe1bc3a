"""Compile the FP8 Triton kernels and the decode attention kernels for a Hopper GPU (sm_90) on a
machine without one: Triton's own compiler and the `ptxas` its wheel ships, driven as
`triton.tools.compile` drives them, with the argument hints a real launch gives (16-byte aligned
pointers, strides and sizes divisible by 16; the row count unspecialised). Run as a script (the tests
start it in a process of its own: Triton's CPU interpreter, which the tests' conftest turns on,
replaces the compiler in the process that sets it). Prints one line per kernel variant and exits
non-zero if one fails to compile.
"""

from __future__ import annotations

import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from server.models.fp8.linear import CONFIGS, GEMV_CONFIGS
from server.models.kernels import attention as A
from server.models.kernels import elementwise as E
from server.models.kernels import fp8 as K
from server.models.kernels import fp8_blocks as KB
from server.models.kernels import latent as L
from server.models.kernels import moe as GROUPED
from server.models.kernels import penalties as P
from server.models.kernels import route as R

TARGET = GPUTarget("cuda", 90, 32)
GEMM = {"X": "*bf16", "XS": "*fp32", "STATIC": "*fp32", "W": "*fp8e4nv", "WS": "*fp32", "B": "*bf16", "OUT": "*bf16",
        "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_om": "i32"}
QUANTIZE = {"X": "*bf16", "XQ": "*fp8e4nv", "XS": "*fp32", "STATIC": "*fp32", "K": "i32", "stride_x": "i32",
            "stride_q": "i32"}
GEMV = {"X": "*bf16", "W": "*fp8e4nv", "WS": "*fp32", "B": "*bf16", "OUT": "*bf16", "N": "i32", "K": "i32",
        "stride_xm": "i32", "stride_wn": "i32", "stride_om": "i32"}
SCALE = {"ACC": "*fp32", "XS": "*fp32", "WS": "*fp32", "B": "*bf16", "OUT": "*bf16", "M": "i32", "N": "i32",
         "stride_a": "i32", "stride_o": "i32"}

PENALISE = {"LOGITS": "*fp32", "OUT": "*fp32", "INDEX": "*i64", "COUNT_ROWS": "*i64", "COUNTS": "*i32",
            "IN_PROMPT": "*u8", "REP": "*fp32", "FREQ": "*fp32", "PRES": "*fp32", "vocab": "i32", "stride_l": "i32",
            "stride_o": "i32", "stride_c": "i32", "stride_p": "i32"}
ROUTE = {"LOGITS": "*bf16", "WEIGHTS": "*fp32", "IDS": "*i64", "LOAD": "*i64", "ROUND_LIKE": "*bf16",
         "num_experts": "i32", "stride_l": "i32", "scale": "fp32", "eps": "fp32"}
ALIGN = {"IDS": "*i64", "ROWS": "*i64", "TILE_EXPERT": "*i64", "pairs": "i32", "num_experts": "i32", "total": "i32"}
MOE_INTS = {"pairs": "i32", "top_k": "i32", "hidden": "i32", "inter": "i32", "num_experts": "i32"}
# the grouped kernels of the FP8 experts (W8A8: X, H float8 with their row scales XS, HS; S the weights')
GATE_UP = {"X": "*fp8e4nv", "XS": "*fp32", "W": "*fp8e4nv", "S": "*fp32", "ROWS": "*i64", "TILE_EXPERT": "*i64",
           "H": "*bf16", **MOE_INTS, "stride_xm": "i32", "stride_we": "i32", "stride_wn": "i32", "stride_se": "i32",
           "stride_sn": "i32", "stride_hm": "i32"}
DOWN = {"H": "*fp8e4nv", "HS": "*fp32", "W": "*fp8e4nv", "S": "*fp32", "SCALE": "*fp32", "ROWS": "*i64",
        "TILE_EXPERT": "*i64", "Y": "*bf16", **{k: v for k, v in MOE_INTS.items() if k != "top_k"},
        "stride_hm": "i32", "stride_we": "i32", "stride_wn": "i32", "stride_se": "i32", "stride_sn": "i32",
        "stride_ym": "i32"}
MOE_TILES = sorted({t for tiles in GROUPED.CANDIDATES.values() for t in tiles})  # what the warm-up may choose
BLOCK_GEMM = {"X": "*bf16", "W": "*fp8e4nv", "S": "*fp32", "B": "*bf16", "OUT": "*bf16", "M": "i32", "N": "i32",
              "K": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_sn": "i32", "stride_om": "i32"}
# the float grouped kernels, with block-scaled float8 weights (W float8, S their scales)
BLOCK_GATE_UP = {**GATE_UP, "X": "*bf16"}
BLOCK_DOWN = {**DOWN, "H": "*bf16"}
# decode attention: dense K/V (bf16 or FP8) and a latent cache, at the 8B and DeepSeek-V2-Lite shapes
PARTIALS = {"BT": "*i32", "SEQ": "*i32", "LO": "*i32", "OP": "*fp32", "MP": "*fp32", "LP": "*fp32"}
DECODE = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", **PARTIALS, "stride_qt": "i32", "stride_qh": "i32",
          "stride_ks": "i32", "stride_kt": "i32", "stride_kh": "i32", "stride_bt": "i32", "sm_scale_log2": "fp32"}
LATENT = {"Q": "*bf16", "C": "*bf16", **PARTIALS, "stride_qt": "i32", "stride_qh": "i32", "stride_cs": "i32",
          "stride_ct": "i32", "stride_bt": "i32", "sm_scale_log2": "fp32"}
ROPE = {"QKV": "*bf16", "COS": "*fp32", "SIN": "*fp32", "K": "*bf16", "V": "*bf16", "SLOT": "*i32", "OFF": "*i32",
        "stride_t": "i32", "stride_c": "i32", "stride_ks": "i32", "stride_kt": "i32", "stride_kh": "i32",
        "k_inv": "fp32", "v_inv": "fp32"}
LATENT_ROPE = {"Q": "*bf16", "KV": "*bf16", "COS": "*bf16", "SIN": "*bf16", "stride_qt": "i32", "stride_qh": "i32",
               "stride_kv": "i32", "stride_c": "i32", "q_off": "i32", "kv_off": "i32"}
HEAD_NORM = {"QKV": "*bf16", "QW": "*bf16", "KW": "*bf16", "stride_t": "i32", "eps": "fp32"}
WRITE = {"X": "*bf16", "CACHE": "*bf16", "SLOT": "*i32", "OFF": "*i32", "stride_xt": "i32", "stride_cs": "i32",
         "stride_ct": "i32"}


def compile_one(fn, signature: dict[str, str], constexprs: dict, unspecialised: tuple[str, ...], **options) -> dict:
    sig = {**signature, **{name: "constexpr" for name in constexprs}}
    attrs = {(i,): [["tt.divisibility", 16]] for i, (name, kind) in enumerate(sig.items())
             if kind != "constexpr" and name not in unspecialised}
    kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs), target=TARGET,
                            options=options)
    return {"shared": kernel.metadata.shared, "wgmma": "wgmma.mma_async" in kernel.asm["ptx"],
            "pipelined": "cp.async" in kernel.asm["ptx"]}


def variants():
    for static in (False, True):
        yield K._quantize_rows, QUANTIZE, {"IS_STATIC": static, "BLOCK": 1024}, ("K",), {"num_warps": 4}
    yield K._scale_out, SCALE, {"HAS_BIAS": True, "BLOCK": 1024}, ("M",), {"num_warps": 4}
    for rows, configs in CONFIGS.items():
        for block_n, block_k, warps, stages, swap, quant in configs:
            for static in (False, True) if quant else (False,):  # a static input scale: the GEMM's own quantization
                constexprs = {"HAS_BIAS": not static, "BLOCK_M": rows, "BLOCK_N": block_n, "BLOCK_K": block_k,
                              "SWAP": swap, "PROMOTE": min(K.PROMOTE_K, block_k), "QUANT": quant, "IS_STATIC": static}
                signature = {**GEMM, "X": "*bf16" if quant else "*fp8e4nv"}
                yield K._fp8_gemm, signature, constexprs, ("M",), {"num_warps": warps, "num_stages": stages}
    for block_n, block_k, warps in GEMV_CONFIGS:
        for bias in (False, True):
            yield K._fp8_gemv, GEMV, {"HAS_BIAS": bias, "BLOCK_N": block_n, "BLOCK_K": block_k}, (), \
                {"num_warps": warps, "num_stages": 4}
    for block_m, block_n, block_k, warps in MOE_TILES:
        per_pair = block_m == 1  # (a per-pair tile: 16 rows for tl.dot, its pair the first)
        tiles = {"BLOCK_M": GROUPED.PAIR_ROWS if per_pair else block_m, "BLOCK_N": block_n, "BLOCK_K": block_k,
                 "PROMOTE": min(K.PROMOTE_K, block_k), "PER_PAIR": per_pair}
        w8a8 = {**tiles, "BLOCKED": False, "GROUP_K": block_k, "W8A8": True}
        for fn, signature in ((GROUPED._gate_up_silu, GATE_UP), (GROUPED._down_weighted, DOWN)):  # stride_sn: 1
            yield fn, signature, w8a8, ("pairs", "top_k", "num_experts", "stride_sn"), {"num_warps": warps}
        cut = min(block_k, 128) if per_pair else block_k  # (`_experts` cuts a per-pair tile's K step to the block)
        blocked = {**tiles, "BLOCK_K": cut, "PROMOTE": min(K.PROMOTE_K, cut), "BLOCKED": True, "GROUP_K": 128,
                   "W8A8": False}
        for fn, signature in ((GROUPED._gate_up_silu, BLOCK_GATE_UP), (GROUPED._down_weighted, BLOCK_DOWN)):
            yield fn, signature, blocked, ("pairs", "top_k", "num_experts"), {"num_warps": warps}
    for pp, block_m in ((16, 16), (1024, 16), (1024, 64)):  # the grouped tiles' sort in one program
        yield GROUPED._align, ALIGN, {"BLOCK_M": block_m, "PP": pp, "EB": 16, "FILL": 1024}, \
            ("pairs", "num_experts", "total"), {"num_warps": 8}
    for rows in (1, 32, 64, 256):
        constexprs = {"HAS_BIAS": False, "BLOCK_M": K.block_m(rows), "BLOCK_N": KB.tile_n(rows), "BLOCK_K": 128,
                      "GROUP_K": 128, "IEEE": False}
        yield KB._fp8_block_gemm, BLOCK_GEMM, constexprs, ("M",), {"num_warps": 4, "num_stages": 3}


def decode_variants():
    for kv in ("*bf16", "*fp8e4nv"):
        for block_n in (32, 64, 128):  # what scripts/bench_decode_kernel.py times
            constexprs = {"KVH": 8, "G": 4, "GP": 16, "D": 128, "TPB": 32, "NSPLIT": 2, "BLOCK_N": block_n,
                          "IEEE": False, "FP16_DOT": kv == "*fp8e4nv"}
            yield A._decode_split, {**DECODE, "K": kv, "V": kv}, constexprs, ("stride_bt",), \
                {"num_warps": 4, "num_stages": 2}
    constexprs = {"G": 16, "GP": 16, "R": 512, "P": 64, "TPB": 32, "NSPLIT": 2, "BLOCK_N": L.LATENT_BLOCK_N,
                  "IEEE": False}
    yield L._latent_split, LATENT, constexprs, ("stride_bt",), {"num_warps": 8, "num_stages": 2}
    yield L._write_rows, WRITE, {"W": 576, "WP": 1024}, (), {"num_warps": 4}
    # Qwen3's per-head q and k norms (head_dim 128, 32 q heads)
    yield E._head_rms_norm, HEAD_NORM, {"D": 128, "HEADS": 32, "NORMED": 40, "ROWS": 64, "BLOCK": 128}, ("eps",), \
        {"num_warps": 4}
    for interleave in (True, False):  # MLA's rotary at DeepSeek-V2-Lite's shape (16 heads, rope 64)
        yield L._latent_rope, LATENT_ROPE, {"H": 16, "ROWS": 16, "HALF": 32, "INTERLEAVE": interleave}, (), \
            {"num_warps": 4}
    # rope_write: the 8B shape into a bf16 and an FP8 (bytes) cache, and a half rotary (GLM-4's)
    shape = {"H": 32, "KVH": 8, "D": 128, "QK": 64, "VH": 8, "DP": 128}
    for kv, rotary in (("*bf16", 128), ("*u8", 128), ("*bf16", 64)):
        constexprs = {**shape, "R": rotary, "HALF": rotary // 2, "PASS": 128 - rotary if rotary < 128 else 0,
                      "QUANT": kv == "*u8"}
        yield E._rope_write, {**ROPE, "K": kv, "V": kv}, constexprs, ("k_inv", "v_inv"), {"num_warps": 4}
    # the sampler's fused penalties (float32 logits, int32 counts, prompt flags as bytes)
    yield P._penalise, PENALISE, {"BLOCK": P.BLOCK}, ("vocab",), {"num_warps": 4}
    # a MoE gate's fused top-k: Qwen3-30B-A3B's (128 experts, top 8, bf16 logits, rounded weights) and
    # DeepSeek-V2-Lite's (64, top 6, float32 logits, no rounding)
    yield R._route, ROUTE, {"TOP_K": 8, "EP": 128, "SIGMOID": False, "NORM": True}, ("scale", "eps"), \
        {"num_warps": 1}
    yield R._route, {**ROUTE, "LOGITS": "*fp32", "ROUND_LIKE": "*fp32"}, \
        {"TOP_K": 6, "EP": 64, "SIGMOID": False, "NORM": False}, ("scale", "eps"), {"num_warps": 1}


def main() -> int:
    failed = 0
    for fn, signature, constexprs, unspecialised, options in [*variants(), *decode_variants()]:
        try:
            print(fn.__name__, constexprs, options, compile_one(fn, signature, constexprs, unspecialised, **options),
                  flush=True)
        except Exception as exc:  # noqa: BLE001 (report every variant, then fail)
            failed += 1
            print("FAILED", fn.__name__, constexprs, options, exc, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
