"""Token sampling for one step, batched on the logits' device (one host copy of the ids per step:
server/engine/inflight.py). vLLM's order: on the raw logits, min_tokens (EOS and stop ids
forbidden), logit_bias, then the penalties (server/engine/penalties.py); greedy rows (penalised too)
take the argmax; sampling rows divide by their temperature, then apply min_p, top-k and top-p.
Log-probabilities come from the raw logits instead (server/engine/logprobs.py).

Sampling is argmax(scores - log E) with E ~ Exp(1) per row (the exponential race, as Gumbel-max):
one argmax samples the whole batch. A seeded row draws its noise from a CPU generator seeded with a
64-bit hash of (seed, choice, output position) (`noise_seed`), so its tokens depend on nothing else:
not the batch, not the server that sampled its earlier tokens, not the rows a verify step drew before
(a rejected position is redrawn with its key). Host values go up with non-blocking copies (`upload`):
a step's sampling queues behind its forward and returns at once.
"""

from __future__ import annotations

import hashlib

import torch

from server.engine.penalties import StepPenalties, TokenCounts, apply_logit_bias
from server.engine.request import Request
from server.engine.structured.bitmask import StepMask
from server.engine.uploads import upload as _upload

MIN_TEMPERATURE = 1e-5  # smaller ones divide logits to inf (NaN probabilities); this close to 0 it is greedy anyway


def sample_on_device(logits: torch.Tensor, requests: list, counts: TokenCounts | None = None,
                     mask: StepMask | None = None) -> torch.Tensor:
    """One token per row of `logits` (float32 [rows, vocab]), as [rows] ids on its device (only queued
    on a GPU). `requests`: per row a `Request` or a `VerifyRow`. `counts`: the engine's token counts of
    penalised requests, bumped with the ids picked (None: a throwaway one from the requests' tokens).
    `mask`: the structured-output rows' allowed tokens (the others -inf, before biases and penalties:
    -inf stays -inf through both)."""
    logits = _mask_banned(logits, requests)
    if mask is not None:  # structured output (server/engine/structured/)
        logits = mask.apply(logits)
    logits = apply_logit_bias(logits, requests)
    penalties = None
    if any(r.sampling.penalized for r in requests):
        counts = counts if counts is not None else TokenCounts(logits.device)
        penalties = StepPenalties(requests, counts, logits.shape[1])
        logits = penalties.apply(logits)
    picked = logits.argmax(dim=-1)  # [num_requests]; ties -> first index, as transformers
    random_rows = [i for i, r in enumerate(requests) if not r.sampling.greedy]
    if random_rows:
        rows = _upload(random_rows, torch.int64, logits.device)
        chosen = _sample_rows(logits.index_select(0, rows), [requests[i] for i in random_rows])
        picked = picked.index_copy(0, rows, chosen)
    if penalties is not None:
        penalties.record(picked)
    return picked


def _mask_banned(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Forbid EOS and stop ids until `min_tokens` tokens exist (transformers' MinNewTokens rule)."""
    rows: list[int] = []
    cols: list[int] = []
    for row, request in enumerate(requests):
        if request.num_output_tokens < request.sampling.min_tokens:  # a pending token counts
            banned = request.eos_token_ids | set(request.sampling.stop_token_ids)
            rows.extend([row] * len(banned))
            cols.extend(banned)
    if not rows:
        return logits
    logits = logits.clone()
    index = _upload(rows + cols, torch.int64, logits.device)
    logits.index_put_((index[:len(rows)], index[len(rows):]), logits.new_full((), float("-inf")))
    return logits


def _sample_rows(logits: torch.Tensor, requests: list) -> torch.Tensor:
    """logits [R, vocab] of requests that sample -> [R] token ids (on the device)."""
    device = logits.device
    temps = _upload([max(r.sampling.temperature, MIN_TEMPERATURE) for r in requests], torch.float32, device)
    scores = logits / temps[:, None]
    min_ps = [r.sampling.min_p for r in requests]
    if any(min_ps):
        scores = _min_p(scores, min_ps)
    ks = [r.sampling.top_k if 0 < r.sampling.top_k < scores.shape[1] else 0 for r in requests]
    ps = [r.sampling.top_p for r in requests]
    if any(ks) or any(p < 1.0 for p in ps):
        scores = _top_k_top_p(scores, ks, ps)
    noise = _exponential(scores.shape, requests, device)
    return (scores - noise.log()).argmax(dim=-1)


def _min_p(scores: torch.Tensor, min_ps: list[float]) -> torch.Tensor:
    """Drop per row the tokens whose probability is below min_p x the most likely token's (0: none)."""
    probs = torch.softmax(scores, dim=-1)
    floor = _upload(min_ps, torch.float32, scores.device)[:, None] * probs.amax(dim=-1, keepdim=True)
    return scores.masked_fill(probs < floor, float("-inf"))


def _top_k_top_p(scores: torch.Tensor, ks: list[int], ps: list[float]) -> torch.Tensor:
    """Keep per row its top_k scores (0: all) and then the smallest set of most likely tokens whose
    probability mass reaches top_p; everything else becomes -inf."""
    sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
    vocab = scores.shape[1]
    ranks = torch.arange(vocab, device=scores.device)[None, :]
    k = _upload([k or vocab for k in ks], torch.int64, scores.device)[:, None]
    drop = ranks >= k
    sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
    probs = torch.softmax(sorted_scores, dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of the tokens ranked above
    top_p = _upload(ps, torch.float32, scores.device)[:, None]
    drop = before >= top_p
    drop[:, 0] = False  # the most likely token always stays (a tiny top_p, or rounding, would drop them all)
    sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
    return torch.empty_like(scores).scatter_(1, order, sorted_scores)


def noise_seed(seed: int, choice: int, position: int) -> int:
    """The 64-bit seed of a seeded row's noise: a hash of the request's seed, its choice index and
    the output position the row samples."""
    digest = hashlib.blake2b(f"{seed}:{choice}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _exponential(shape: torch.Size, requests: list, device: torch.device) -> torch.Tensor:
    """Exp(1) noise [R, vocab]: seeded rows from CPU generators keyed by their position (one upload
    for all of them), the rest batched on the device."""
    noise = torch.empty(shape, device=device).exponential_()
    seeded = [i for i, r in enumerate(requests) if r.sampling.seed is not None]
    if seeded:
        own = torch.empty(len(seeded), shape[1])
        for at, i in enumerate(seeded):
            row = requests[i]
            generator = torch.Generator().manual_seed(noise_seed(row.sampling.seed, row.choice, row.output_position))
            own[at].exponential_(generator=generator)
        own = own.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else own
        noise.index_copy_(0, _upload(seeded, torch.int64, device), own)
    return noise
