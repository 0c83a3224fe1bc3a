"""Token sampling for one step: greedy, temperature, top-k, top-p, per-request seeds, min_tokens."""

from __future__ import annotations

import torch

from server.engine.request import Request


def sample(logits: torch.Tensor, requests: list[Request]) -> list[int]:
    """Pick one token per row. `logits`: float32 [num_requests, vocab], row i belongs to requests[i]."""
    logits = _mask_banned(logits, requests)
    greedy = logits.argmax(dim=-1)  # [num_requests]; ties -> first index, as transformers
    tokens = greedy.tolist()
    for row, request in enumerate(requests):
        if not request.sampling.greedy:
            tokens[row] = _sample_row(logits[row], request)
    return tokens


def _mask_banned(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Forbid EOS and stop ids until `min_tokens` tokens exist (transformers' MinNewTokens rule)."""
    rows: list[int] = []
    cols: list[int] = []
    for row, request in enumerate(requests):
        if len(request.output_token_ids) < request.sampling.min_tokens:
            banned = request.eos_token_ids | set(request.sampling.stop_token_ids)
            rows.extend([row] * len(banned))
            cols.extend(banned)
    if not rows:
        return logits
    logits = logits.clone()
    logits[rows, cols] = float("-inf")
    return logits


def _sample_row(row: torch.Tensor, request: Request) -> int:
    params = request.sampling
    scores = row / params.temperature  # [vocab]
    if params.top_k > 0 and params.top_k < scores.numel():
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        scores = _top_p_filter(scores, params.top_p)
    probs = torch.softmax(scores, dim=-1)
    generator = request.generator
    if generator is not None and generator.device != probs.device:
        probs = probs.cpu()
    return int(torch.multinomial(probs, 1, generator=generator).item())


def _top_p_filter(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability mass reaches top_p."""
    sorted_scores, order = torch.sort(scores, descending=True)
    cumulative = torch.softmax(sorted_scores, dim=-1).cumsum(dim=-1)
    drop = cumulative - torch.softmax(sorted_scores, dim=-1) >= top_p  # mass before this token already enough
    sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
    return torch.empty_like(scores).scatter_(0, order, sorted_scores)
