"""The start-up warm-up of the GPU fast path: the step shapes the scheduler produces run once before
the first request, so no request pays for a Triton compile, a cuDNN plan or another first use.

What varies between steps, and how each is covered:
- pointer alignment and per-step integers (token counts, block-table widths): not specialised on
  (every index part is 16-byte aligned, attention.HostInts; `do_not_specialize` on the kernels'
  varying integers), so one compile serves every step;
- the decode kernel's split count, a compile-time constant chosen from the decode batch size
  (kernels.attention.decode_splits): one mixed prefill+decode step per distinct split count over
  batch sizes 1..max_batch_size, each with a fresh prompt (dense prefill) and a chunk after a
  cached prefix (the paged prefill kernel) (`warm_steps`);
- cuDNN prefill plans: one per prompt-length bucket up to max_num_tokens (dense_prefill.warm_up);
  FlashAttention (shorter prompts) and cuDNN run one call per prompt, batch 1, so the number of
  prompts in a step asks for no plan of its own;
- decode-only steps: CUDA graphs captured per batch bucket (cuda_graphs.py).

What a burst of fresh prompts adds (`burst_steps`, run after the capture, CUDA only: these are
costs of CUDA's lazy first uses, none of them exists on a CPU):
- the first launch of each captured graph: torch instantiates a graph without uploading it, so its
  first `cudaGraphLaunch` uploads it; a burst's mixed steps (k prompts of a few tokens + decode rows,
  as one-token rows) reach buckets that decode-only steps of max_batch_size rows never do. One
  replayed step per bucket, through `runner.execute` as serving runs it (`replay_plan`);
- eager steps of token counts no warm-up step had: a step of many prompts runs the GEMMs with M =
  its token count, and cuBLAS picks its kernel per M range, each kernel loaded at its first launch
  (torch sets CUDA_MODULE_LOADING=LAZY); the language model head runs with M = the step's logit
  rows (1..max_batch_size); the per-prompt attention calls run at lengths no single-prompt step
  had; the caching allocator's blocks are split in new ways. One eager step per point of a
  geometric grid of token counts, STEPS_PER_DOUBLING per doubling from the largest graph bucket
  (max_batch_size without graphs) to max_num_tokens, each of k fresh prompts plus decode rows
  whose numbers rise together to max_batch_size rows at max_num_tokens (max_prefill_batch_tokens
  changes how many prompts share a step, not the token and row counts the grid spans);
- with async scheduling a decode row's token is the previous step's sampled id, gathered on the
  device (runner.PendingTokens: its index_copy_ in an eager step, the graphs' pending source): the
  burst steps' decode rows take their tokens that way.
Steps added: len(cuda_graphs.batch_buckets(min(max_num_tokens, max_batch_size + runner.MIXED_ROWS)))
replayed (17 for max_batch_size 64: 9 + (max_batch_size + 256 - 64) / 32) plus at most
ceil(STEPS_PER_DOUBLING * log2(max_num_tokens / that largest bucket)) eager (10 for max_num_tokens
8192). On the 8B shape: 31,824 tokens of eager steps (~0.8 s at the 4k prefill's ~25 us a token),
17 replays of <= 320 rows (~0.1 s) and ten eager launches of up to 64 sequences (~0.3 s): ~1-2 s.

Not covered here (they are not the runner's): the sampler's per-call pinned uploads of sampling
rows (non-greedy requests; each new size class of torch's pinned host cache is a cudaHostAlloc) and
`inflight.TokenStaging` growing past max_batch_size int64 when a step returns logprobs.
Nothing is cached yet while this runs, so what the steps write into the pool is never read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from server.models.kernels.attention import decode_splits

STEPS_PER_DOUBLING = 2  # eager burst steps per doubling of the token count (a grid of ratio sqrt 2)


@dataclass(frozen=True)
class WarmStep:
    decode_rows: int  # sequences with one new token each
    prompts: tuple[int, ...] = ()  # fresh prompts' lengths (nothing cached before them)
    chunk_tokens: int = 0  # a chunk after a cached prefix of `chunk_past` tokens (0: none)
    chunk_past: int = 0
    pending: bool = False  # the decode rows read their token on the device (async scheduling)

    @property
    def num_tokens(self) -> int:
        return self.decode_rows + sum(self.prompts) + self.chunk_tokens

    @property
    def num_chunks(self) -> int:
        return self.decode_rows + len(self.prompts) + (1 if self.chunk_tokens else 0)


def warm_steps(max_batch: int, max_tokens: int, tpb: int, kv_heads: int, num_sms: int) -> list[WarmStep]:
    """One step per distinct decode split count, the first also carrying the largest fresh prompt
    the token budget allows (the GEMM and attention shapes of a full prefill step)."""
    batches: dict[int, int] = {}
    for b in range(1, max_batch + 1):
        batches.setdefault(decode_splits(b, kv_heads, num_sms), b)
    steps = []
    for i, rows in enumerate(sorted(batches.values())):
        chunk = tpb if rows + tpb + 1 <= max_tokens else 0
        budget = max_tokens - rows - chunk
        prompt = budget if i == 0 else min(budget, 2 * tpb)
        steps.append(WarmStep(rows, (prompt,) if prompt > 0 else (), chunk, tpb if chunk else 0))
    return steps


def burst_steps(max_batch: int, max_tokens: int, buckets: list[int]) -> list[WarmStep]:
    """The steps a burst of fresh prompts adds (module docstring): one replayed step per graph
    bucket (`buckets`: the decode graphs' row buckets, [] without graphs), then the eager steps of
    `token_grid`."""
    replayed = [_replayed(rows, max_batch) for rows in buckets]
    grid = token_grid(buckets[-1] if buckets else max_batch, max_tokens)
    counts = [min(max_batch, max(1, round(max_batch ** ((j + 1) / len(grid))))) for j in range(len(grid))]
    return replayed + [_eager(tokens, chunks) for tokens, chunks in zip(grid, counts, strict=True)]


def token_grid(low: int, high: int) -> list[int]:
    """Token counts above `low` up to `high`: STEPS_PER_DOUBLING per doubling, `high` the last."""
    out, j = [], 1
    while (tokens := math.ceil(low * 2 ** (j / STEPS_PER_DOUBLING))) < high:
        out.append(tokens)
        j += 1
    return out + [high] if high > low else []


def _replayed(rows: int, max_batch: int) -> WarmStep:
    """`rows` one-token rows: decode rows and one fresh prompt (a mixed step that fits the bucket
    exactly, its logit rows within max_batch_size); a single decode row for the bucket of 1."""
    if rows == 1:
        return WarmStep(1, pending=True)
    decode = min(rows - 2, max_batch - 1)
    return WarmStep(decode, (rows - decode,), pending=True)


def _eager(tokens: int, chunks: int) -> WarmStep:
    """`tokens` in `chunks` sequences: half of them decode rows, the rest fresh prompts of equal
    length (the last takes the remainder), each at least two tokens."""
    decode = chunks // 2
    prefill = tokens - decode
    count = max(1, min(chunks - decode, prefill // 2))
    each = prefill // count
    return WarmStep(decode, (each,) * (count - 1) + (prefill - each * (count - 1),), pending=True)


def blocks_needed(step: WarmStep, tpb: int) -> int:
    """Blocks the longest sequence of `step` spans (every sequence of it shares the same slots)."""
    longest = max(1 + tpb, *step.prompts, step.chunk_past + step.chunk_tokens)
    return math.ceil(longest / tpb)
