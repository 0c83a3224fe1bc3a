"""GPU figures of the mixture-of-experts models, engine level, in one process: b1 TPOT and c=64 decode
tok/s of a Qwen3-30B-A3B-shaped and a DeepSeek-V2-Lite-shaped model against the bytes a step reads,
and the MLA model's KV bytes per token against a dense model of the same width.

Builds (once each, under --workdir) two random-weight bfloat16 models as Hugging Face directories
(config.json from transformers' own config class, one safetensors shard per layer, the tiny
tokenizer of `builtin:tiny-llama`), as `pdserve_bench.gpu_handoff.build_model` does for the 8B shape:

- `qwen3moe`: `Qwen3MoeForCausalLM`, hidden 2048, 32 heads, 4 kv heads, head_dim 128, 128 experts,
  top-8, moe_intermediate_size 768, norm_topk_prob, vocab 151,936 (48 layers in the real model);
- `dsv2lite`: `DeepseekV2ForCausalLM`, hidden 2048, 16 heads, q_lora_rank null, kv_lora_rank 512,
  qk_nope 128, qk_rope 64, v 128, 64 routed experts + 2 shared, top-6, moe_intermediate_size 1408,
  the first layer dense (intermediate 10,944), vocab 102,400 (27 layers in the real model).

Weights are N(0, 0.02) (norms 1), so activations stay small and finite in bf16; the lm_head rows of
every id at or above the tokenizer's 512 and of its special ids are 0, so every greedy token decodes
to text. `--layers` (default 16 for both) cuts the depth so both models fit the GPU machine's disk
and load quickly: a decode step's time and its bytes both scale with the layers, so the ratios
against the roofline of the same layers stay fair (the embedding row and lm_head weigh a little
more against the shallower stack than in the real models).

Each model's engine is built as `pdserve serve` builds it (`server_config_from_dict` + `build_core`:
weights, KV pool, warm-up with graph capture) and driven without HTTP (`bench_gpu.submit` / `drive`):

- `bandwidth`: bench_gpu_load_engine's ceilings measured in the same run: HBM read GB/s (`x.sum()`
  over 4 GiB), pinned host-to-device GB/s and bf16 GEMM TFLOP/s; on a CPU the RAM read rate. The
  roofline divides by the read rate (`read_gb_s`);
- `b1`: median ms per decode step of one request (--input-len in, --output-len out, greedy), against
  the bytes one b1 step reads / bandwidth: every non-expert weight (attention, norms, router gates,
  shared experts, the dense first layers' MLP, lm_head), one embedding row, the top_k routed experts
  of each MoE layer, and the KV cache of the mean context (`core.kv.layout.bytes_per_token()` x
  (input + output / 2)). Goal: tpot / roofline <= 1.3;
- `c64`: output tok/s over the decode-only steps of --batch requests in flight, against
  batch / (bytes of one such step / bandwidth): the non-expert weights, the experts the batch
  touches, the batch's embedding rows and KV. The experts touched are measured: a separate, untimed
  pass of the same workload reads each MoE block's device-side token counts (`MoEBlock.load`, what
  /metrics reports) after every step, and counts per layer the experts with tokens in the steps that
  routed exactly `batch` tokens (one decode step); `routing` says "measured", or "uniform" when no
  such step was seen, then E * (1 - (1 - k / E) ** batch) per layer (the expectation for uniform
  routing, printed beside the measured count in either case). Goal: tok/s / roofline >= 0.7;
- `kv_handoff`: the KV bytes a token costs in the DeepSeek-V2-Lite-shaped model's cache (what a
  handoff sends per token: its latent, kv_lora_rank + qk_rope_head_dim values a layer) against a dense
  Llama-shaped MHA cache of the same width (its heads, head_dim = hidden / heads = 128: 2 x heads x
  head_dim values a layer). Computed twice: from the real shape's `ModelSpec.cache_layout` (the
  function the engine lays its cache out with; a config-only directory, no weights, no GPU) and from
  the built engine's `core.kv.layout`. Goal: <= 1/7;
- `texts` (skip with `--skip texts`): greedy texts of an aggregated server and of a context +
  generation pair (tests/deploy_harness.py, configs/aggregated.yaml and disagg.yaml) are equal.

Prints one JSON line per figure and a final `SUMMARY {...}` line; `--out FILE` appends the records as
JSON lines. `--tiny` shrinks everything (8 experts, hidden 64, 2 layers, vocab 512, 4 requests) so
the whole script runs on a CPU in well under a minute: the smoke test (tests/unit/test_bench_gpu_moe.py).

    python3 scripts/bench_gpu_moe.py --workdir /tmp/bench-moe --out $OUT/bench_gpu_moe.jsonl
    OMP_NUM_THREADS=1 python3 scripts/bench_gpu_moe.py --workdir /tmp/bench-moe-tiny --tiny --skip texts  # CPU smoke
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import re
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
from bench_gpu import drive, submit
from bench_gpu_load_engine import memory_ceilings, prompt

from kvcache import CacheLayout, KVFormat
from server.config.schema import server_config_from_dict
from server.engine.core import EngineCore
from server.engine_host.build import build_core
from server.models.builtin import resolve_model
from server.models.model_spec import ModelSpec, load_spec
from server.models.moe.block import moe_blocks
from server.models.weights import read_header, safetensors_files
from server.telemetry.metrics import ServerMetrics

ROOT = Path(__file__).resolve().parents[1]
TEXT_TOKENS = 512  # the tiny tokenizer's size: prompt ids are drawn from [10, 500)
GOALS = {"b1_vs_roofline": 1.3, "c64_vs_roofline": 0.7, "kv_mla_vs_dense": 1 / 7}
TEXT_PROMPTS = ["The quick brown fox", "abc " * 100]
IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)  # the tiny tokenizer's

QWEN3_MOE = dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                 num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True, intermediate_size=6144,
                 decoder_sparse_step=1, mlp_only_layers=[], vocab_size=151936, rms_norm_eps=1e-6,
                 max_position_embeddings=40960, rope_theta=1000000.0)
DSV2_LITE = dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512,
                 qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64, n_shared_experts=2,
                 num_experts_per_tok=6, moe_intermediate_size=1408, intermediate_size=10944, first_k_dense_replace=1,
                 n_group=1, topk_group=1, topk_method="greedy", routed_scaling_factor=1.0, norm_topk_prob=False,
                 vocab_size=102400, rms_norm_eps=1e-6, max_position_embeddings=163840, rope_theta=10000.0)
TINY = {  # --tiny: CPU-sized shapes of the same construction
    "qwen3moe": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                     num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=128, vocab_size=TEXT_TOKENS),
    "dsv2lite": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
                     qk_rope_head_dim=16, v_head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                     moe_intermediate_size=32, intermediate_size=128, vocab_size=TEXT_TOKENS),
}


@dataclass(frozen=True)
class Shape:
    name: str  # --models name
    architecture: str
    config_class: str  # transformers' config class
    dims: dict
    real_layers: int


SHAPES = {"qwen3moe": Shape("qwen3moe", "Qwen3MoeForCausalLM", "Qwen3MoeConfig", QWEN3_MOE, 48),
          "dsv2lite": Shape("dsv2lite", "DeepseekV2ForCausalLM", "DeepseekV2Config", DSV2_LITE, 27)}


# ---- records --------------------------------------------------------------------------------------

class Records:
    """One JSON line per figure on stdout, appended to `out` as it comes (a cut-short run keeps its lines)."""

    def __init__(self, out: Path | None) -> None:
        self.out, self.rows = out, []
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)

    def add(self, figure: str, **values: object) -> dict:
        row = {"figure": figure, **values}
        self.rows.append(row)
        line = json.dumps(row)
        print(line, flush=True)
        if self.out is not None:
            with self.out.open("a") as f:
                f.write(line + "\n")
        return row


# ---- the models -----------------------------------------------------------------------------------

def model_dims(shape: Shape, tiny: bool) -> dict:
    return {**shape.dims, **(TINY[shape.name] if tiny else {})}


def write_config(shape: Shape, dims: dict, layers: int, out: Path) -> None:
    """config.json through transformers' own config class (the installed version's keys)."""
    import transformers

    config_class = getattr(transformers, shape.config_class)
    config_class(architectures=[shape.architecture], num_hidden_layers=layers, tie_word_embeddings=False,
                 torch_dtype="bfloat16", **IDS, **dims).save_pretrained(out)


def copy_tokenizer(out: Path) -> list[int]:
    """The tiny tokenizer's files into `out`; its special ids."""
    from transformers import AutoTokenizer

    tiny = resolve_model("builtin:tiny-llama")
    for f in tiny.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, out / f.name)
    return list(AutoTokenizer.from_pretrained(tiny).all_special_ids)


def layer_shapes(shape: Shape, d: dict, layer: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of one decoder layer, by its HF name (experts one tensor per expert and projection)."""
    p, h = f"model.layers.{layer}.", d["hidden_size"]
    out: dict[str, tuple[int, ...]] = {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
    a, heads = p + "self_attn.", d["num_attention_heads"]
    if shape.name == "qwen3moe":
        hd, kv = d["head_dim"], d["num_key_value_heads"] * d["head_dim"]
        out |= {a + "q_proj.weight": (heads * hd, h), a + "k_proj.weight": (kv, h), a + "v_proj.weight": (kv, h),
                a + "o_proj.weight": (h, heads * hd), a + "q_norm.weight": (hd,), a + "k_norm.weight": (hd,)}
        num, shared, dense = d["num_experts"], 0, False
    else:
        rank, nope, rope, v = d["kv_lora_rank"], d["qk_nope_head_dim"], d["qk_rope_head_dim"], d["v_head_dim"]
        out |= {a + "q_proj.weight": (heads * (nope + rope), h), a + "kv_a_proj_with_mqa.weight": (rank + rope, h),
                a + "kv_a_layernorm.weight": (rank,), a + "kv_b_proj.weight": (heads * (nope + v), rank),
                a + "o_proj.weight": (h, heads * v)}
        num, shared = d["n_routed_experts"], d["n_shared_experts"] * d["moe_intermediate_size"]
        dense = layer < d["first_k_dense_replace"]
    if dense:
        return out | mlp_shapes(p + "mlp.", h, d["intermediate_size"])
    out[p + "mlp.gate.weight"] = (num, h)
    for e in range(num):
        out |= mlp_shapes(f"{p}mlp.experts.{e}.", h, d["moe_intermediate_size"])
    return out | (mlp_shapes(p + "mlp.shared_experts.", h, shared) if shared else {})


def mlp_shapes(prefix: str, hidden: int, inter: int) -> dict[str, tuple[int, ...]]:
    return {prefix + "gate_proj.weight": (inter, hidden), prefix + "up_proj.weight": (inter, hidden),
            prefix + "down_proj.weight": (hidden, inter)}


def build_moe_model(shape: Shape, out: Path, layers: int, tiny: bool) -> Path:
    """Random bf16 weights of `shape` (written shard by shard, drawn on the GPU when there is one);
    config.json last, so a directory with one is complete."""
    from safetensors.torch import save_file

    if (out / "config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    dims = model_dims(shape, tiny)
    special = copy_tokenizer(out)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(0)

    def tensor(name: str, size: tuple[int, ...]) -> torch.Tensor:
        if name.endswith("norm.weight"):
            return torch.ones(size, dtype=torch.bfloat16)
        return (torch.randn(size, generator=gen, device=device, dtype=torch.bfloat16) * 0.02).cpu()

    h, vocab = dims["hidden_size"], dims["vocab_size"]
    lm_head = tensor("lm_head.weight", (vocab, h))
    lm_head[TEXT_TOKENS:] = 0  # logit 0 never wins against ~500 random logits of either sign
    lm_head[special] = 0
    save_file({"model.embed_tokens.weight": tensor("embed", (vocab, h)), "lm_head.weight": lm_head,
               "model.norm.weight": tensor("norm.weight", (h,))}, out / "model-00000.safetensors")
    for layer in range(layers):
        shapes = layer_shapes(shape, dims, layer)
        save_file({n: tensor(n, s) for n, s in shapes.items()}, out / f"model-{layer + 1:05d}.safetensors")
    write_config(shape, dims, layers, out)
    return out


def layout_only_dir(shape: Shape, out: Path, layers: int) -> Path:
    """A directory `load_spec` reads (config.json of the real shape, tokenizer, one placeholder
    tensor): the layout the engine would lay out, without weights or a GPU."""
    from safetensors.torch import save_file

    if not (out / "config.json").exists():
        out.mkdir(parents=True, exist_ok=True)
        copy_tokenizer(out)
        save_file({"placeholder": torch.zeros(1)}, out / "model.safetensors")
        write_config(shape, shape.dims, layers, out)
    return out


# ---- bytes a step reads ---------------------------------------------------------------------------

EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.")


@dataclass(frozen=True)
class StepBytes:
    """Bytes of the checkpoint's tensors as a decode step reads them (in the engine's dtype)."""

    non_expert: int  # read whole by every step: attention, norms, router gates, shared experts, dense MLPs, lm_head
    embed_row: int  # one token's embedding row
    expert: int  # one routed expert of one layer (gate + up + down)
    moe_layers: int
    num_experts: int
    top_k: int

    def b1(self, kv_bytes: float) -> float:
        return self.non_expert + self.embed_row + self.moe_layers * self.top_k * self.expert + kv_bytes

    def batch(self, tokens: int, experts_touched: float, kv_bytes: float) -> float:
        """`experts_touched`: summed over the MoE layers."""
        return self.non_expert + tokens * self.embed_row + experts_touched * self.expert + kv_bytes


def step_bytes(model_dir: Path, spec: ModelSpec, element_bytes: int) -> StepBytes:
    non_expert, experts, embed_row = 0, {}, 0
    for path in safetensors_files(model_dir):
        for name, info in read_header(path).items():
            size = math.prod(info["shape"]) * element_bytes
            match = EXPERT.match(name)
            if match:
                key = (int(match[1]), int(match[2]))
                experts[key] = experts.get(key, 0) + size
            elif name == "model.embed_tokens.weight":
                embed_row = info["shape"][1] * element_bytes
            else:
                non_expert += size
    moe_layers = sum(spec.moe.sparse_layers)
    return StepBytes(non_expert, embed_row, max(experts.values()), moe_layers, spec.moe.num_experts, spec.moe.top_k)


def uniform_distinct(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts one layer's step touches when each token picks top_k of num_experts
    uniformly at random."""
    return num_experts * (1 - (1 - top_k / num_experts) ** tokens)


# ---- the machine ----------------------------------------------------------------------------------

def _read_rate(ceilings: dict[str, float]) -> dict[str, float]:
    """bench_gpu_load_engine's ceilings (HBM read, pinned H2D, GEMM; a CPU's RAM read), the read rate
    as `read_gb_s`: the roofline's denominator."""
    return {"read_gb_s": ceilings.pop("hbm_read_gb_s"), **ceilings}


# ---- the engine -----------------------------------------------------------------------------------

def make_core(model_dir: Path, args: argparse.Namespace) -> tuple[EngineCore, float]:
    max_seq = args.input_len + args.output_len + 64
    cfg = server_config_from_dict({
        "model": str(model_dir), "max_seq_len": max_seq, "max_batch_size": args.batch,
        "max_num_tokens": max(max_seq, min(8192, args.batch * args.input_len)),
        "kv_cache_config": {"tokens_per_block": 32, "max_tokens": (args.batch + 2) * max_seq},
        "cache_transceiver_config": {"auth_token": "bench-gpu-moe-token-0123456789"}}, "bench_gpu_moe")
    start = time.perf_counter()
    core = build_core(cfg, ServerMetrics())
    _sync()
    return core, time.perf_counter() - start


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def b1_tpot_ms(core: EngineCore, args: argparse.Namespace) -> tuple[float, float]:
    """(median, mean) ms per decode step of one request; the first decode step is left out."""
    submit(core, prompt(args.input_len), 4)  # warm-up: this prompt length's prefill
    drive(core)
    rid = submit(core, prompt(args.input_len), args.output_len)
    times, _ = drive(core)
    tokens = times[rid]
    gaps = [(b - a) * 1000 for a, b in zip(tokens[1:], tokens[2:], strict=False)]
    return statistics.median(gaps), statistics.fmean(gaps)


def batch_decode(core: EngineCore, args: argparse.Namespace) -> tuple[float, float, int]:
    """(output tok/s, median step ms, steps) over the decode-only steps of --batch requests in flight."""
    for _ in range(args.batch):
        submit(core, prompt(args.input_len), args.output_len)
    _, steps = drive(core)
    decode = [(s, n) for s, n, only_decode in steps if only_decode]
    return sum(n for _, n in decode) / sum(s for s, _ in decode), statistics.median(s for s, _ in decode) * 1000, len(
        decode)


def routed_experts(core: EngineCore, args: argparse.Namespace) -> list[float] | None:
    """Per MoE layer, the mean distinct experts of the steps that routed exactly --batch tokens (an
    untimed pass of the c=64 workload; the blocks' counts read after every step). None: no such step."""
    blocks = list(moe_blocks(core.runner.model).values())
    if not blocks:
        return None
    top_k = blocks[0].spec.top_k
    for _ in range(args.batch):
        submit(core, prompt(args.input_len), min(args.output_len, 32))
    counts = [torch.stack([b.load for b in blocks]).cpu()]
    while core.has_work():
        core.step()
        counts.append(torch.stack([b.load for b in blocks]).cpu())
    distinct = []
    for before, after in zip(counts, counts[1:], strict=False):
        step = after - before  # [layers, experts]: tokens routed in this step
        if bool((step.sum(1) == args.batch * top_k).all()):
            distinct.append((step > 0).sum(1).double())
    return torch.stack(distinct).mean(0).tolist() if distinct else None


def release_memory() -> None:
    """After the last reference to an engine is gone: its GPU memory back before the next model."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- figures --------------------------------------------------------------------------------------

def dense_layout(spec: ModelSpec, dtype: torch.dtype) -> CacheLayout:
    """A dense Llama-shaped MHA cache of the same width: the model's heads, head_dim = hidden / heads."""
    fmt = KVFormat(dtype, spec.num_heads, spec.hidden_size // spec.num_heads)
    return CacheLayout((1024,) * spec.num_layers, fmt, "cpu", 1024)


def kv_figure(rec: Records, source: str, spec: ModelSpec, layout: CacheLayout) -> dict:
    dense = dense_layout(spec, layout.format.dtype)
    mla = spec.mla
    formula = (mla.kv_lora_rank + mla.qk_rope_head_dim) / (2 * spec.num_heads * (spec.hidden_size // spec.num_heads))
    ratio = layout.bytes_per_token() / dense.bytes_per_token()
    return rec.add("kv_handoff", source=source, model=str(spec.model_dir), layers=spec.num_layers,
                   dtype=str(layout.format.dtype).removeprefix("torch."), mla_bytes_per_token=layout.bytes_per_token(),
                   dense_bytes_per_token=dense.bytes_per_token(), kv_mla_vs_dense=ratio, formula=formula,
                   formula_text="(kv_lora_rank + qk_rope_head_dim) / (2 * heads * hidden / heads)",
                   dense_reduction=1 / ratio, goal=f"<= 1/7 ({GOALS['kv_mla_vs_dense']:.4f})",
                   met=ratio <= GOALS["kv_mla_vs_dense"])


def engine_figures(rec: Records, shape: Shape, model_dir: Path, read_gb_s: float, args: argparse.Namespace,
                   skip: set[str]) -> dict:
    core, startup_s = make_core(model_dir, args)
    spec = load_spec(model_dir)
    element = torch.empty(0, dtype=core.runner.dtype).element_size()
    sb = step_bytes(model_dir, spec, element)
    kv_token = core.kv.layout.bytes_per_token()
    context = args.input_len + args.output_len / 2  # the mean context of a decode step
    common = dict(model=shape.name, layers=spec.num_layers, real_layers=shape.real_layers)
    rec.add("engine", **common, startup_s=startup_s, kernels=core.runner.kernels, dtype=str(core.runner.dtype),
            kv_bytes_per_token=kv_token, non_expert_bytes=sb.non_expert, expert_bytes=sb.expert,
            moe_layers=sb.moe_layers, num_experts=sb.num_experts, top_k=sb.top_k)
    out = {}
    if spec.mla is not None:
        out["kv_engine"] = kv_figure(rec, "engine", spec, core.kv.layout)["kv_mla_vs_dense"]
    if "b1" not in skip:
        median, mean = b1_tpot_ms(core, args)
        nbytes = sb.b1(kv_token * context)
        roof = nbytes / read_gb_s / 1e6
        out["b1"] = rec.add("b1", **common, tpot_ms=median, tpot_mean_ms=mean, step_bytes=nbytes, roofline_ms=roof,
                            b1_vs_roofline=median / roof, goal="<= 1.3", met=median / roof <= GOALS["b1_vs_roofline"],
                            input_len=args.input_len, output_len=args.output_len)
    if "c64" not in skip:
        out["c64"] = batch_figure(rec, core, sb, kv_token * context, read_gb_s, common, args)
    del core
    release_memory()
    return out


def batch_figure(rec: Records, core: EngineCore, sb: StepBytes, kv_per_seq: float, read_gb_s: float, common: dict,
                 args: argparse.Namespace) -> dict:
    tok_s, step_ms, steps = batch_decode(core, args)
    measured = routed_experts(core, args)
    uniform = uniform_distinct(sb.num_experts, sb.top_k, args.batch)
    touched = sum(measured) if measured else sb.moe_layers * uniform
    nbytes = sb.batch(args.batch, touched, kv_per_seq * args.batch)
    roof_tok_s = args.batch / (nbytes / read_gb_s / 1e9)
    return rec.add("c64", **common, batch=args.batch, tok_s=tok_s, step_ms=step_ms, decode_steps=steps,
                   step_bytes=nbytes, roofline_tok_s=roof_tok_s, c64_vs_roofline=tok_s / roof_tok_s, goal=">= 0.7",
                   met=tok_s / roof_tok_s >= GOALS["c64_vs_roofline"], routing="measured" if measured else "uniform",
                   distinct_experts_per_layer=touched / sb.moe_layers, uniform_distinct_per_layer=uniform,
                   measured_per_layer=measured, input_len=args.input_len, output_len=args.output_len)


def texts_figure(rec: Records, shape: Shape, model_dir: Path, args: argparse.Namespace) -> dict:
    """Greedy texts of an aggregated server and a context + generation pair of `model_dir`."""
    sys.path.insert(0, str(ROOT / "tests"))
    import deploy_harness

    max_seq = 1024
    overrides = {"model": str(model_dir), "max_seq_len": max_seq, "max_num_tokens": max_seq, "max_batch_size": 8,
                 "kv_cache_config": {"max_tokens": 8 * max_seq}}
    texts, start = {}, time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"texts-{shape.name}-", dir=args.workdir) as tmp:
        for label, config in (("aggregated", "aggregated.yaml"), ("disaggregated", "disagg.yaml")):
            (Path(tmp) / label).mkdir()
            with deploy_harness.launched(config, Path(tmp) / label, overrides) as dep:
                texts[label] = deploy_harness.greedy_texts(dep.url, TEXT_PROMPTS, args.text_len, timeout_s=300)
    equal = texts["aggregated"] == texts["disaggregated"]
    return rec.add("texts", model=shape.name, equal=equal, seconds=time.perf_counter() - start,
                   max_tokens=args.text_len, aggregated=texts["aggregated"], disaggregated=texts["disaggregated"])


# ---- main -----------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/bench-moe"))
    parser.add_argument("--out", type=Path, help="append the records to this JSON-lines file")
    parser.add_argument("--layers", type=int, help="decoder layers of both models (default 16; --tiny: 2)")
    parser.add_argument("--models", default="qwen3moe,dsv2lite", help=f"comma-separated of {sorted(SHAPES)}")
    parser.add_argument("--skip", default="", help="comma-separated of: b1, c64, texts, engine (all engine figures)")
    parser.add_argument("--batch", type=int, help="requests in flight for the c=64 figure (default 64; --tiny: 4)")
    parser.add_argument("--input-len", type=int, help="prompt tokens (default 128; --tiny: 16)")
    parser.add_argument("--output-len", type=int, help="output tokens (default 128; --tiny: 8)")
    parser.add_argument("--text-len", type=int, default=16, help="tokens of each greedy text (texts)")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke sizes: 8 experts, hidden 64, 2 layers")
    args = parser.parse_args(argv)
    defaults = dict(layers=2, batch=4, input_len=16, output_len=8) if args.tiny else dict(
        layers=16, batch=64, input_len=128, output_len=128)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    unknown = set(args.models.split(",")) - set(SHAPES)
    if unknown:
        parser.error(f"--models: unknown {sorted(unknown)}; known: {sorted(SHAPES)}")
    return args


SUMMARY_KEYS = {"b1": {"tpot_ms": "b1_tpot_ms", "b1_vs_roofline": "b1_vs_roofline"},
                "c64": {"tok_s": "c64_tok_s", "c64_vs_roofline": "c64_vs_roofline", "routing": "routing"},
                "texts": {"equal": "texts_equal"}}


def summary(rows: list[dict]) -> dict:
    """Per model its headline figures; the KV ratios by source; the read bandwidth."""
    out: dict[str, object] = {}
    for row in rows:
        figure = row["figure"]
        if figure in SUMMARY_KEYS:
            per_model = out.setdefault(row["model"], {})
            per_model.update({new: row[old] for old, new in SUMMARY_KEYS[figure].items()})
        elif figure == "kv_handoff":
            out.setdefault("kv_mla_vs_dense", {})[row["source"]] = row["kv_mla_vs_dense"]
        elif figure == "bandwidth":
            out["read_gb_s"] = row["read_gb_s"]
        elif figure == "error":
            out.setdefault("errors", []).append(f"{row['model']} {row['step']}: {row['error'][:200]}")
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    rec = Records(args.out)
    torch.manual_seed(0)
    args.workdir.mkdir(parents=True, exist_ok=True)
    rec.add("run", device=torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
            torch=torch.__version__, layers=args.layers, models=args.models, tiny=args.tiny, batch=args.batch,
            input_len=args.input_len, output_len=args.output_len, skip=sorted(skip))
    dsv2 = SHAPES["dsv2lite"]
    real = layout_only_dir(dsv2, args.workdir / f"dsv2lite-layout-{args.layers}", args.layers)
    real_spec = load_spec(real)
    kv_figure(rec, "layout (real shape, no weights)", real_spec, real_spec.cache_layout(1024, torch.bfloat16, "cpu"))
    read_gb_s = rec.add("bandwidth", **_read_rate(memory_ceilings()))["read_gb_s"] if "engine" not in skip else 0.0
    built, wanted = {}, [] if {"engine", "texts"} <= skip else args.models.split(",")
    for name in wanted:
        shape = SHAPES[name]
        start = time.perf_counter()
        built[name] = build_moe_model(shape, args.workdir / f"{name}{'-tiny' if args.tiny else ''}-{args.layers}",
                                      args.layers, args.tiny)
        rec.add("model", model=name, dir=str(built[name]), build_s=time.perf_counter() - start, layers=args.layers)
        if "engine" not in skip:
            guarded(rec, name, engine_figures, rec, shape, built[name], read_gb_s, args, skip)
    for name, model_dir in built.items() if "texts" not in skip else []:
        guarded(rec, name, texts_figure, rec, SHAPES[name], model_dir, args)
    print("SUMMARY " + json.dumps(summary(rec.rows)), flush=True)
    return 1 if any(r["figure"] == "error" for r in rec.rows) else 0


def guarded(rec: Records, model: str, fn, *args: object) -> None:
    """`fn(*args)`; an exception becomes an `error` line (the traceback on stderr) and the next model runs."""
    try:
        fn(*args)
    except Exception as exc:  # one model's failure (e.g. out of memory) leaves the other's figures
        traceback.print_exc()
        rec.add("error", model=model, step=fn.__name__, error=f"{type(exc).__name__}: {exc}"[:2000])
        release_memory()


if __name__ == "__main__":
    sys.exit(main())
