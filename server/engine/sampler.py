"""Token sampling for one step, batched on the logits' device: greedy, temperature, top-k, top-p,
per-request seeds, min_tokens. One host copy of the chosen token ids per step.

Sampling from softmax(scores) is done as argmax(scores - log E) with E ~ Exp(1) drawn per row
(the exponential race, equivalent to Gumbel-max): every row of the batch is sampled by one argmax.
A request with a seed draws its row's noise from its own generator, so its tokens depend only on
its seed and its logits, never on what else is in the batch.

Nothing here waits for the device: host values go up with non-blocking copies (`_upload`;
`torch.tensor(values, device=cuda)` would synchronise the stream), so async scheduling can queue a
step's sampling behind its forward and return at once.
"""

from __future__ import annotations

import torch

from server.engine.request import Request
from server.engine.structured.bitmask import StepMask

MIN_TEMPERATURE = 1e-5  # smaller ones divide logits to inf (NaN probabilities); this close to 0 it is greedy anyway


def sample(logits: torch.Tensor, requests: list[Request]) -> list[int]:
    """Pick one token per row. `logits`: float32 [num_requests, vocab], row i belongs to requests[i]."""
    return sample_on_device(logits, requests).tolist()


def sample_on_device(logits: torch.Tensor, requests: list[Request], mask: StepMask | None = None) -> torch.Tensor:
    """`sample` without the host copy: [num_requests] token ids on the logits' device (on a GPU the
    work is only queued, so the caller can do host work before it waits for the ids). `mask`: the
    structured-output rows' allowed tokens (the others -inf)."""
    logits = _mask_banned(logits, requests)
    if mask is not None:  # structured output (server/engine/structured/)
        logits = mask.apply(logits)
    greedy = logits.argmax(dim=-1)  # [num_requests]; ties -> first index, as transformers
    random_rows = [i for i, r in enumerate(requests) if not r.sampling.greedy]
    if not random_rows:
        return greedy
    rows = _upload(random_rows, torch.int64, logits.device)
    chosen = _sample_rows(logits.index_select(0, rows), [requests[i] for i in random_rows])
    return greedy.index_copy(0, rows, chosen)


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


def _sample_rows(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """logits [R, vocab] of requests that sample -> [R] token ids (on the device)."""
    device = logits.device
    temps = _upload([max(r.sampling.temperature, MIN_TEMPERATURE) for r in requests], torch.float32, device)
    scores = logits / temps[:, None]
    ks = [r.sampling.top_k if 0 < r.sampling.top_k < scores.shape[1] else 0 for r in requests]
    ps = [r.sampling.top_p for r in requests]
    if any(ks) or any(p < 1.0 for p in ps):
        scores = _top_k_top_p(scores, ks, ps)
    noise = _exponential(scores.shape, requests, device)
    return (scores - noise.log()).argmax(dim=-1)


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


def _exponential(shape: torch.Size, requests: list[Request], device: torch.device) -> torch.Tensor:
    """Exp(1) noise [R, vocab]: seeded rows from their own generator (CPU), the rest batched."""
    noise = torch.empty(shape, device=device).exponential_()
    for row, request in enumerate(requests):
        if request.generator is not None:
            own = torch.empty(shape[1]).exponential_(generator=request.generator)
            noise[row] = own.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else own
    return noise


def _upload(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on `device`, copied without waiting for the device's queued work (from
    pinned memory, which torch keeps until the copy has run)."""
    host = torch.tensor(values, dtype=dtype)
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host
