"""The model runner: one forward over a flattened batch of prefill chunks and decode tokens.

The runner owns the model weights and (through the attention backend) reads and writes the KV
pool that `kvcache.KVCacheManager` allocated; the scheduler hands it `SeqChunk`s that say which
tokens to compute and where their blocks are (primary slots). Logits come back in chunk order.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import torch

from server.models import dense_prefill
from server.models.attention import AttentionBackend, PagedKV, SeqLayout, StepLayout, TorchPagedAttention
from server.models.deepseek import DeepseekModel
from server.models.fp8.load import load_checkpoint
from server.models.fp8.weight import Fp8Weight
from server.models.llama import LlamaModel
from server.models.mla_attention import TorchLatentAttention
from server.models.model_spec import ModelSpec, load_spec
from server.models.moe import moe_blocks
from server.models.moe.block import RouteFn
from server.models.moe.config import MoESpec
from server.models.moe.experts import ExpertsFn, dense_experts
from server.models.moe.load import ExpertLoad
from server.models.ops import TorchOps, TritonOps, Weight
from server.models.parallel.context import RankShard

if TYPE_CHECKING:
    from server.models.warmup import WarmStep

log = logging.getLogger(__name__)


class SeqChunk(msgspec.Struct, array_like=True):
    """One sequence of a step; a tensor-parallel server's rank 0 sends its steps' to the other ranks
    (server/tp/messages.py `Forward`)."""

    token_ids: list[int]  # new tokens computed this step (a prefill chunk or 1 decode token)
    num_past: int  # tokens already in the cache; positions start here
    slot_tables: dict[int, list[int]]  # window -> primary slots of the request's blocks, token order;
    # covers num_past + len(token_ids) tokens; -1 = released (sliding, out of window)
    need_logits: bool  # logits of the chunk's last token wanted
    num_logits: int = 1  # with need_logits: logits of its last num_logits tokens (a verify chunk: all)


@dataclass
class PendingTokens:
    """Input tokens still on the device (async scheduling): the one token of chunk `i` is
    `source[rows[i]]`, sampled by the step before; that chunk's `token_ids` hold a placeholder."""

    source: torch.Tensor  # [M] int64 token ids sampled by the previous step, on the runner's device
    rows: dict[int, int]  # chunk index (a one-token chunk) -> row of `source`


@dataclass
class StepInputs:
    """One step's device inputs, flattened with decode tokens first."""

    token_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    logit_rows: torch.Tensor  # [N] int64, rows whose logits are returned, in chunk order
    attn_meta: object  # the attention backend's plan, shared by all layers


def resolve_device(name: str | torch.device = "auto") -> torch.device:
    """"auto" -> CUDA when present, else CPU."""
    if str(name) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str | torch.dtype, device: torch.device) -> torch.dtype:
    """"auto" -> bfloat16 on CUDA, float32 elsewhere; otherwise a torch dtype name like "float16"."""
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype {name!r} is not a floating point torch dtype (or 'auto')")
    return dtype


def load_weights(spec: ModelSpec, dtype: torch.dtype, device: torch.device, quantization: str | None = None,
                 shard: RankShard | None = None) -> dict[str, Weight]:
    """Every safetensors tensor of the model (or `shard`'s slices) as `dtype` on `device`; the linear
    weights as FP8 where the checkpoint is FP8 or `quantization` is "fp8" (server/models/fp8/load.py)."""
    if shard is not None:
        return shard.load(spec, dtype, device, quantization)
    return load_checkpoint(spec, dtype=dtype, device=device, quantization=quantization)


KERNELS = ("auto", "torch", "triton")
MIXED_ROWS = 256  # graph buckets past max_batch_size: short prefill chunks ride in a replay as rows
PREFILL_ROW_READS = 1 << 20  # cached tokens a replayed step's multi-token chunks may read in all


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_kernels(name: str, device: torch.device) -> str:
    """"auto" -> "triton" on CUDA when Triton is installed, else "torch" (CPU: always torch)."""
    if name not in KERNELS:
        raise ValueError(f"kernels must be one of {KERNELS}, got {name!r}")
    if name == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("kernels: triton needs a CUDA device (or TRITON_INTERPRET=1, Triton's CPU "
                         "interpreter, for tests)")
    return name


def _fused_experts(gate_up: Weight) -> ExpertsFn:
    """The Triton path's experts: the grouped GEMMs (float, FP8 per channel, or a block-scaled
    checkpoint's float8 weights widened in the float kernels: fp8/weight.py `from_block_checkpoint`)."""
    from server.models.kernels.moe import fused_experts, fused_fp8_experts

    return fused_fp8_experts if isinstance(gate_up, Fp8Weight) and not gate_up.block_k else fused_experts


def _fused_route(spec: MoESpec) -> RouteFn | None:
    from server.models.kernels import route

    return route.fused_route if route.fits(spec) else None


class ModelRunner:
    def __init__(self, model_dir: Path, kv: PagedKV, *, dtype: torch.dtype, device: torch.device,
                 max_num_tokens: int, max_batch_size: int,
                 tensors: dict[str, Weight] | None = None, kernels: str = "auto",
                 cuda_graphs: bool = True, max_seq_len: int | None = None, shard: RankShard | None = None,
                 quantization: str | None = None) -> None:
        """`tensors`: the weights already loaded (`load_weights`); else loaded here, `quantization`
        "fp8" quantizing a float checkpoint's linears. `kernels`: "torch" or "triton" (CUDA: paged
        kernels, fused ops, and with `cuda_graphs` decode graphs captured by `warm_up`). `shard`: one
        tensor-parallel rank's part (its weight slices and kv heads); `spec` stays the whole model's."""
        self.spec: ModelSpec = load_spec(model_dir)
        self.device, self.dtype = device, dtype
        self.max_num_tokens, self.max_batch_size = max_num_tokens, max_batch_size
        local = self.spec if shard is None else shard.local_spec(self.spec)  # what this process computes
        _check_kv(local, kv, dtype)
        self.kv = kv
        self.kernels = resolve_kernels(kernels, device)
        self.attention, ops = self._backend(local, max_seq_len or max(kv.window_sizes))
        if tensors is None:
            tensors = load_weights(self.spec, dtype, device, quantization, shard)
        model_cls = LlamaModel if local.mla is None else DeepseekModel
        self.model = model_cls(local, tensors, self.attention, dtype=dtype, device=device, ops=ops,
                               parallel=None if shard is None else shard.context)
        blocks = moe_blocks(self.model)
        for block in blocks.values():
            if self.kernels == "triton":  # a MoE model's routed experts: two grouped GEMMs; its top-k: one kernel
                block.experts = _fused_experts(block.gate_up)
                block.fused_route = _fused_route(block.spec)
            if shard is not None and shard.dispatch is not None:
                block.dispatch = shard.dispatch
        self.expert_load = ExpertLoad(blocks)  # tokens per expert, for /metrics
        self.graphs = None
        if self.kernels == "triton" and cuda_graphs and not isinstance(self.attention, TorchLatentAttention):
            from server.models.cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(self.model, self.attention, max_batch_size,
                                       max_rows=min(max_num_tokens, max_batch_size + MIXED_ROWS))

    def _backend(self, spec: ModelSpec, max_seq_len: int) -> tuple[AttentionBackend, TorchOps]:
        ops = TritonOps(spec.rms_norm_eps) if self.kernels == "triton" else TorchOps(spec.rms_norm_eps)
        if spec.mla is not None:  # latent attention: Triton decode (not for an FP8 latent), else the torch MLA
            args = (self.kv, spec.num_layers, spec.num_heads, spec.mla.kv_lora_rank, spec.mla.softmax_scale,
                    self.dtype)
            if self.kernels == "triton":
                from server.models.triton_latent import TritonLatentAttention, supports

                if supports(spec.mla, self.kv.layer_latent(0).dtype):
                    return TritonLatentAttention(*args, max_seq_len=max_seq_len), ops
            return TorchLatentAttention(*args), ops
        if self.kernels == "triton":
            from server.models.triton_attention import TritonPagedAttention

            return TritonPagedAttention(self.kv, spec.num_layers, spec.num_heads, spec.head_dim,
                                        max_seq_len=max_seq_len), ops
        return TorchPagedAttention(self.kv, spec.num_layers, spec.num_heads, spec.head_dim, self.dtype), ops

    def warm_up(self) -> float:
        """Run the step shapes the scheduler produces once and capture the decode graphs, so no
        request pays for a compile, a plan or a first use (server/models/warmup.py says what varies);
        returns the seconds it took (0 on the torch path)."""
        if self.kernels != "triton":
            return 0.0
        from server.models.kernels.variants import compiled_variants  # Triton: imported on this path only

        start = time.perf_counter()
        # a latent-attention model's prefill runs the torch MLA: no step shapes, prefill plans or skinny
        # GEMMs to warm; its decode kernels compile as the graphs are captured
        plans, plan_s = self._warm_dense_steps() if self.model.spec.mla is None else (0, 0.0)
        self._choose_expert_tiles()
        if self.graphs is not None:
            self.graphs.capture()
        bursts, burst_s = self._warm_bursts()
        if self.device.type == "cuda":  # (the Triton path runs on the CPU under TRITON_INTERPRET in tests)
            torch.cuda.synchronize(self.device)
        self.expert_load.reset()  # the warm-up's steps routed no request's tokens
        log.info("warm-up: Triton variants %s, %d cuDNN prefill plans in %.1f s, %d burst steps in %.1f s",
                 compiled_variants(), plans, plan_s, bursts, burst_s)
        return time.perf_counter() - start

    def _warm_dense_steps(self) -> tuple[int, float]:
        """A K/V-heads model's step shapes, cuDNN prefill plans and skinny GEMMs; (plans, their seconds)."""
        from server.models.warmup import warm_steps

        for step in warm_steps(self.max_batch_size, self.max_num_tokens, self.kv.tokens_per_block,
                               self.attention.num_kv_heads, self.attention.num_sms):
            self.forward(self.prepare(self._warm_chunks(step)))
        spec = self.model.spec  # a tensor-parallel rank's own heads
        plans = dense_prefill.warm_up(spec.num_heads, self.attention.num_kv_heads, spec.head_dim, self.dtype,
                                      self.device, self.max_num_tokens)
        self._choose_skinny_linears()
        return plans

    def _warm_bursts(self) -> tuple[int, float]:
        """The steps a burst of fresh prompts adds (`warmup.burst_steps`), CUDA only; (steps, seconds)."""
        if self.device.type != "cuda":
            return 0, 0.0
        from server.models.warmup import burst_steps

        steps = burst_steps(self.max_batch_size, self.max_num_tokens, self.graphs.buckets if self.graphs else [])
        seconds = self.run_warm_steps(steps)
        if self.graphs is not None:
            self.graphs.mixed_replays = 0  # the metric counts serving's replays
        return len(steps), seconds

    def run_warm_steps(self, steps: list[WarmStep]) -> float:
        """Run `warmup.WarmStep`s as serving runs them (`execute`); returns the seconds they took."""
        start = time.perf_counter()
        source = torch.zeros(self.max_batch_size, dtype=torch.int64, device=self.device)
        for step in steps:
            pending = PendingTokens(source, {i: i for i in range(step.decode_rows)}) \
                if step.pending and step.decode_rows else None
            self.execute(self._warm_chunks(step), pending)
        return time.perf_counter() - start

    def _choose_skinny_linears(self) -> None:
        """Time our Triton GEMMs against cuBLAS for each layer weight shape (`TritonOps.choose_linear`),
        before graph capture, so the graphs hold the faster one."""
        ops = self.model.ops
        if not isinstance(ops, TritonOps) or self.device.type != "cuda":
            return
        layers = self.model.layers
        for name in ("qkv", "o"):
            ops.choose_linear([getattr(w, name) for w in layers], [getattr(w, f"{name}_bias") for w in layers],
                              self.dtype)
        mlps = [layer.dense_mlp for layer in layers if layer.dense_mlp is not None]  # (a MoE block's experts: none)
        for name in ("gate_up", "down") if mlps else ():
            ops.choose_linear([getattr(m, name) for m in mlps], [getattr(m, f"{name}_bias") for m in mlps], self.dtype)
        log.info("GEMM per weight shape (float: rows <= 16; FP8: NxK@rows): %s", ops.chosen_linears())

    def _choose_expert_tiles(self) -> None:
        """MoE models on CUDA: the grouped expert GEMMs' tile per step size, timed per experts' shape
        (kernels/moe.py `choose_tiles`); before graph capture, so the graphs hold the chosen tiles."""
        from server.models.kernels import moe as kernels

        if self.device.type != "cuda":
            return
        computes: dict[tuple, bool] = {}  # block-scaled experts' shape -> do the grouped kernels compute them
        for block in moe_blocks(self.model).values():
            if block.experts is kernels.fused_experts and isinstance(block.gate_up, Fp8Weight):
                shape = tuple(block.gate_up.shape)
                if shape not in computes:
                    computes[shape] = kernels.block_experts_compute(block.gate_up, block.down, self.dtype)
                if not computes[shape]:
                    block.experts = dense_experts  # this GPU's grouped block-scaled kernels computed wrong
            if block.experts in (kernels.fused_experts, kernels.fused_fp8_experts):
                kernels.choose_tiles(block.experts, block.gate_up, block.down, block.spec.top_k, self.dtype,
                                     self.max_num_tokens)
        if kernels.CHOSEN:
            log.info("MoE tiles (experts, intermediate, hidden, weight dtype, pairs): %s", kernels.CHOSEN)

    def _warm_chunks(self, step: WarmStep) -> list[SeqChunk]:
        """A `warmup.WarmStep`'s first max_batch_size chunks on the pool's first slots, prompts cut to fit."""
        from server.models.warmup import blocks_needed

        tpb = self.kv.tokens_per_block
        slots = min(self.kv.num_slots(w) for w in self.kv.window_sizes)
        tables = {w: list(range(min(slots, blocks_needed(step, tpb)))) for w in self.kv.window_sizes}
        past = tpb if slots >= 2 else 0
        chunks = [SeqChunk([1], past, tables, True) for _ in range(step.decode_rows)]
        chunks += [SeqChunk([1] * min(n, max(1, (slots - 1) * tpb)), 0, tables, True) for n in step.prompts]
        if step.chunk_tokens and slots >= 2:
            chunks.append(SeqChunk([1] * step.chunk_tokens, step.chunk_past, tables, True))
        return chunks[:self.max_batch_size]

    @torch.no_grad()
    def execute(self, chunks: list[SeqChunk], pending: PendingTokens | None = None) -> torch.Tensor:
        """Run one step; float32 logits [sum of num_logits of chunks with need_logits, vocab], in chunk order.
        `pending`: chunks whose token is taken on the device from the previous step's sampled ids.
        A replayed step returns a view of its graph's output, which the next replay overwrites."""
        replay = replay_plan(chunks, self.graphs.fits) if self.graphs is not None else None
        if replay is not None:
            self._check_limits(chunks)
            rows, logit_rows = replay
            picks = [-1] * len(rows)
            starts = first_rows(chunks) if pending else []
            for i, row in (pending.rows.items() if pending else ()):
                picks[starts[i]] = row
            return self.graphs.run([_seq_layout(c) for c in rows], [c.token_ids[0] for c in rows],
                                   picks, pending.source if pending else None, logit_rows)
        return self.forward(self.prepare(chunks, pending))

    def prepare(self, chunks: list[SeqChunk], pending: PendingTokens | None = None) -> StepInputs:
        """Host work of a step: flatten the chunks (decode tokens first), copy the inputs to the device
        in one copy, build the attention plan. Pending tokens are gathered on the device."""
        self._check_limits(chunks)
        order = sorted(range(len(chunks)), key=lambda i: len(chunks[i].token_ids) != 1)
        token_ids, positions, last_row = [], [], {}
        for i in order:
            c = chunks[i]
            token_ids += c.token_ids
            positions += range(c.num_past, c.num_past + len(c.token_ids))
            last_row[i] = len(token_ids) - 1
        rows = [row for i, c in enumerate(chunks) if c.need_logits
                for row in range(last_row[i] - c.num_logits + 1, last_row[i] + 1)]
        layout = StepLayout([_seq_layout(chunks[i]) for i in order],
                            num_decode=sum(len(c.token_ids) == 1 for c in chunks))
        t, n = len(token_ids), len(rows)
        picks = list(pending.rows.items()) if pending else []
        into, take = [last_row[i] for i, _ in picks], [row for _, row in picks]
        ints = torch.tensor(token_ids + positions + rows + into + take, dtype=torch.int64).to(
            self.device, non_blocking=True)
        tokens, pos = ints[:t], ints[t:2 * t]
        if picks:
            at = 2 * t + n
            tokens.index_copy_(0, ints[at:at + len(picks)], pending.source.index_select(0, ints[at + len(picks):]))
        return StepInputs(tokens, pos, ints[2 * t:2 * t + n], self.attention.plan(layout, pos))

    @torch.no_grad()
    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Device work of a step: no host synchronisation in here."""
        return self.model.forward(inputs.token_ids, inputs.positions, inputs.attn_meta, inputs.logit_rows)

    def _check_limits(self, chunks: list[SeqChunk]) -> None:
        num_tokens = sum(len(c.token_ids) for c in chunks)
        if not chunks or num_tokens > self.max_num_tokens or len(chunks) > self.max_batch_size:
            raise ValueError(f"step of {len(chunks)} chunks / {num_tokens} tokens is empty or exceeds "
                             f"max_batch_size={self.max_batch_size} / max_num_tokens={self.max_num_tokens}")
        if any(not c.token_ids for c in chunks):
            raise ValueError("a chunk without tokens")
        if any(not 1 <= c.num_logits <= len(c.token_ids) for c in chunks):
            raise ValueError("num_logits outside 1..len(token_ids)")


def replay_plan(chunks: list[SeqChunk], fits: Callable[[int, int], bool]
                ) -> tuple[list[SeqChunk], list[int] | None] | None:
    """The step as one-token rows a decode graph replays (`as_decode_rows`) and the rows whose logits
    it returns (None: every row's), or None: run it eagerly. So a mixed prefill + decode step replays
    a graph instead of launching some 400 kernels from Python. Eager when the rows or their logits
    do not fit a bucket (`fits`), or the prefill rows would read more than PREFILL_ROW_READS cached
    tokens in all (the decode kernel reads each row's whole context)."""
    multi = [c for c in chunks if len(c.token_ids) > 1]
    if not multi and all(c.need_logits for c in chunks):  # a decode step: its chunks are the rows
        return (chunks, None) if fits(len(chunks), len(chunks)) else None
    if sum(len(c.token_ids) * (c.num_past + len(c.token_ids)) for c in multi) > PREFILL_ROW_READS:
        return None
    wanted, end = [], 0
    for c in chunks:
        end += len(c.token_ids)
        if c.need_logits:
            wanted += range(end - c.num_logits, end)
    if not fits(end, len(wanted)):
        return None
    return as_decode_rows(chunks), None if wanted == list(range(end)) else wanted


def as_decode_rows(chunks: list[SeqChunk]) -> list[SeqChunk]:
    """Each token of each chunk as a one-token chunk at its position, over the same slot tables. A
    layer writes every row's K/V before any row attends, so row j sees rows < j of its own chunk:
    the chunk's causal attention, computed by the decode kernel (and so replayable)."""
    return [SeqChunk([t], c.num_past + j, c.slot_tables, True) for c in chunks for j, t in enumerate(c.token_ids)]


def first_rows(chunks: list[SeqChunk]) -> list[int]:
    """The row of `as_decode_rows(chunks)` that holds each chunk's first token."""
    return list(accumulate((len(c.token_ids) for c in chunks), initial=0))[:-1]


def _seq_layout(chunk: SeqChunk) -> SeqLayout:
    return SeqLayout(chunk.num_past, len(chunk.token_ids), chunk.slot_tables)


def _check_kv(spec: ModelSpec, kv: PagedKV, dtype: torch.dtype) -> None:
    """The cache must have been laid out for this model (`spec.cache_layout`) in the model's dtype,
    or as FP8 (`kv_cache_config.dtype: fp8`); an MLA model's as its latent."""
    for layer in range(spec.num_layers):
        if spec.mla is not None:
            latent = kv.layer_latent(layer)
            if latent.shape[2] != spec.mla.latent_dim or latent.dtype not in (dtype, torch.float8_e4m3fn):
                raise ValueError(f"KV cache layer {layer} ({tuple(latent.shape)} {latent.dtype}) does not fit "
                                 f"model {spec.model_dir} (a latent of {spec.mla.latent_dim} values a token, "
                                 f"dtype {dtype})")
            continue
        k, _ = kv.layer_cache(layer)
        window, wanted = kv.layer_window(layer), spec.layer_windows[layer]
        bad_window = wanted is not None and window > wanted
        bad_dtype = k.dtype not in (dtype, torch.float8_e4m3fn)
        if tuple(k.shape[2:]) != (spec.num_kv_heads, spec.head_dim) or bad_window or bad_dtype:
            raise ValueError(f"KV cache layer {layer} ({tuple(k.shape)} {k.dtype}, window {window}) does "
                             f"not fit model {spec.model_dir} (kv_heads {spec.num_kv_heads}, head_dim "
                             f"{spec.head_dim}, window {wanted}, dtype {dtype})")
