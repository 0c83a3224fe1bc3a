"""Log-probabilities of a step's sampled tokens and of prompt tokens, computed on the device.

A position's log-probabilities are log_softmax of the model's RAW logits of its row (OpenAI's and
vLLM's default: the model's distribution, before min_tokens, biases, penalties, temperature and
truncation). `TokenLogprob.top` holds the k most likely tokens (k: the request's `logprobs`, or
`prompt_logprobs` for prompt tokens), whether or not the token there is among them.

A step computes all its wanted rows at once (one index_select, log_softmax, gather and topk(k_max)):
the sampler rows of requests with `logprobs` (a verify chunk's rows each have theirs) and the prompt
rows of requests with `prompt_logprobs` (the row computing prompt position q gives token q + 1's).
They ride to the host with the step's sampled ids (server/engine/inflight.py), packed as int64 (the
float32 values bit-cast). A prefill chunk with prompt rows returns the logits of all its positions,
and its request reuses no prefix-cached block until they are complete (`Request.max_cached_tokens`).
A generation leg computes none: the context server did.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from server.engine.request import Request
from server.engine.scheduler import ScheduledChunk
from server.engine.uploads import upload
from server.types import TokenLogprob


def prompt_rows(chunk: ScheduledChunk) -> int:
    """How many positions of `chunk` give prompt logprobs still missing: the prompt positions q it
    computes with q + 1 a prompt position too (0 for most chunks)."""
    request = chunk.request
    if not request.prompt_logprobs_missing:
        return 0
    start = request.num_computed_tokens
    end = start + chunk.num_new_tokens - len(chunk.drafts)
    return max(0, min(end, request.num_prompt_tokens - 1) - start)


def logit_span(chunk: ScheduledChunk, num_prompt_rows: int) -> tuple[bool, int]:
    """(need_logits, num_logits) of the runner's `SeqChunk`: every position of a chunk with prompt
    rows, else the sampled one(s)."""
    if num_prompt_rows:
        return True, chunk.num_new_tokens
    return chunk.need_logits, 1 + len(chunk.drafts)


@dataclass(frozen=True)
class PromptPiece:
    """The prompt rows of one chunk: `count` logits rows from `row`, predicting prompt positions
    `first` .. `first + count - 1`."""

    request: Request
    row: int
    first: int
    count: int


@dataclass(frozen=True)
class StepRows:
    """Where a step's logits rows go: the sampler's rows (in `spec.rows` order; None: the logits
    rows are the sampler's, as in a step without prompt rows) and the prompt pieces."""

    sample_index: list[int] | None
    pieces: list[PromptPiece]

    @classmethod
    def of(cls, chunks: list[ScheduledChunk], num_prompt_rows: list[int]) -> StepRows:
        """Before the computed counts move (a chunk's positions start at its request's count)."""
        if not any(num_prompt_rows):
            return cls(None, [])
        sample_index, pieces, at = [], [], 0
        for chunk, n in zip(chunks, num_prompt_rows, strict=True):
            need, width = logit_span(chunk, n)
            if not need:
                continue
            if n:
                pieces.append(PromptPiece(chunk.request, at, chunk.request.num_computed_tokens + 1, n))
            if chunk.need_logits:
                sample_index += range(at + width - 1 - len(chunk.drafts), at + width)
            at += width
        return cls(sample_index, pieces)

    def sampler_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The sampler's rows of the step's logits (all of them when there is no prompt row)."""
        if self.sample_index is None:
            return logits
        return logits.index_select(0, upload(self.sample_index, torch.int64, logits.device))


@dataclass(frozen=True)
class LogprobPlan:
    """How a step's packed logprobs read back: per sampler row its computed row (-1: not asked),
    per computed row its k, then the prompt pieces' rows after the sampled ones."""

    sampled: list[int]
    ks: list[int]
    kmax: int
    pieces: list[PromptPiece]


def launch(logits: torch.Tensor, rows: StepRows, scores: torch.Tensor, sampler_rows: list,
           picked: torch.Tensor | None) -> tuple[torch.Tensor, LogprobPlan] | None:
    """Queue the step's logprobs on the device: packed int64 [n (1 + k_max) float32 bits, then
    n k_max top ids], or None when no row wants any. `scores`: the sampler's logits, one row per
    entry of `sampler_rows` (forked choices' copies included); prompt rows are read from `logits`."""
    wants = [i for i, row in enumerate(sampler_rows) if row.sampling.logprobs is not None]
    if not wants and not rows.pieces:
        return None
    ks = [sampler_rows[i].sampling.logprobs for i in wants]
    prompt_rows: list[int] = []
    targets: list[int] = []
    for piece in rows.pieces:
        prompt_rows += range(piece.row, piece.row + piece.count)
        targets += piece.request.prompt_token_ids[piece.first:piece.first + piece.count]
        ks += [piece.request.sampling.prompt_logprobs] * piece.count
    w, p = len(wants), len(prompt_rows)
    kmax = min(max(ks), logits.shape[1])
    ints = upload(wants + prompt_rows + targets, torch.int64, logits.device)
    selected = [scores.index_select(0, ints[:w])] if w else []
    chosen = ints[w + p:]
    if p:
        selected.append(logits.index_select(0, ints[w:w + p]))
    if w:
        chosen = torch.cat([picked.index_select(0, ints[:w]), chosen])
    logprobs = torch.log_softmax(torch.cat(selected).float(), dim=-1)
    values = logprobs.gather(1, chosen[:, None]).flatten()
    top_ids = None
    if kmax:
        top, top_ids = logprobs.topk(kmax, dim=-1)
        values = torch.cat([values, top.flatten()])
    packed = values.view(torch.int32).to(torch.int64)
    if top_ids is not None:
        packed = torch.cat([packed, top_ids.flatten()])
    sampled = [-1] * len(sampler_rows)
    for j, i in enumerate(wants):
        sampled[i] = j
    return packed, LogprobPlan(sampled, [min(k, kmax) for k in ks], kmax, rows.pieces)


def read(plan: LogprobPlan, tokens: list[int], packed: torch.Tensor
         ) -> tuple[list[TokenLogprob | None], list[tuple[PromptPiece, list[TokenLogprob]]]]:
    """On the host: per sampler row its TokenLogprob (None: not asked; `tokens` are the sampled
    ids), and per prompt piece the entries of its positions."""
    n, k = len(plan.ks), plan.kmax
    values = packed[:n * (1 + k)].to(torch.int32).view(torch.float32).tolist()
    ids = packed[n * (1 + k):].tolist()

    def entry(j: int, token: int) -> TokenLogprob:
        at = j * k
        return TokenLogprob(token, values[j], tuple(zip(ids[at:at + plan.ks[j]], values[n + at:n + at + plan.ks[j]],
                                                        strict=True)))

    sampled = [None if j < 0 else entry(j, tokens[i]) for i, j in enumerate(plan.sampled)]
    pieces, j = [], sum(1 for j in plan.sampled if j >= 0)
    for piece in plan.pieces:
        targets = piece.request.prompt_token_ids[piece.first:piece.first + piece.count]
        pieces.append((piece, [entry(j + m, t) for m, t in enumerate(targets)]))
        j += piece.count
    return sampled, pieces


def fill_prompt(piece: PromptPiece, entries: list[TokenLogprob]) -> None:
    """Store a piece's prompt logprobs in its request (a recomputed position overwrites the same;
    once delivered they are not kept)."""
    request = piece.request
    if request.prompt_logprobs is None:
        return
    for m, entry in enumerate(entries):
        position = piece.first + m
        if request.prompt_logprobs[position] is None:
            request.prompt_logprobs_missing -= 1
        request.prompt_logprobs[position] = entry


def take_sampled(request: Request, n: int) -> list[TokenLogprob] | None:
    """The logprobs of an output's n new tokens, accepted before (None: the request asked for none)."""
    if request.sampling.logprobs is None:
        return None
    taken = request.logprob_queue[:n]
    del request.logprob_queue[:n]
    return taken


def take_prompt(request: Request) -> list[TokenLogprob | None] | None:
    """The prompt's logprobs, once, on the first output after they are complete."""
    if request.prompt_logprobs is None or request.prompt_logprobs_missing:
        return None
    taken, request.prompt_logprobs = request.prompt_logprobs, None
    return taken
