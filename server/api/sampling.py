"""A request's sampling fields -> the engine's `SamplingParams`, with the checks that need the
server (its maximum `n`, the model's vocabulary) or span several fields."""

from __future__ import annotations

from server.api.errors import APIError
from server.api.vocab import check_in_vocab
from server.openai.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest
from server.types import SamplingParams, StructuredSpec

DEFAULT_MAX_N = 16  # choices per prompt (`n`) a server takes unless configured otherwise


def check_choices(body: SamplingRequest, max_n: int) -> None:
    if body.n > max_n:
        raise APIError(400, f"'n': {body.n} choices asked; this server's maximum is {max_n}", param="n")
    best_of = body.best_of if isinstance(body, CompletionRequest) else None
    if best_of is not None and best_of != body.n:
        raise APIError(400, f"'best_of': must equal n ({body.n}); pdserve does not rank extra candidates",
                       param="best_of")


def output_logprobs(body: SamplingRequest) -> int | None:
    """How many alternatives each sampled token's logprob comes with; None: no logprobs."""
    if isinstance(body, ChatCompletionRequest):
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "'top_logprobs': needs logprobs: true", param="top_logprobs")
        return (body.top_logprobs or 0) if body.logprobs else None
    return body.logprobs if isinstance(body, CompletionRequest) else None


def logit_bias(body: SamplingRequest, vocab_size: int) -> tuple[tuple[int, float], ...]:
    out = []
    for key, bias in (body.logit_bias or {}).items():
        token = int(key)
        if not 0 <= token < vocab_size:
            raise APIError(400, f"'logit_bias': token id {token} is outside the vocabulary [0, {vocab_size})",
                           param="logit_bias")
        out.append((token, float(bias)))
    return tuple(sorted(out))


def sampling_params(body: SamplingRequest, max_tokens: int, vocab_size: int, *, structured: StructuredSpec | None,
                    logprobs: int | None, prompt_logprobs: int | None) -> SamplingParams:
    check_in_vocab(body.stop_token_ids or (), vocab_size, "stop_token_ids")
    if body.min_tokens > max_tokens:
        raise APIError(400, f"min_tokens ({body.min_tokens}) must not exceed max_tokens ({max_tokens})",
                       param="min_tokens")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=0 if body.top_k is None else body.top_k,
        min_p=body.min_p or 0.0,
        seed=body.seed,
        stop=(body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ()),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        min_tokens=body.min_tokens,
        ignore_eos=body.ignore_eos,
        n=body.n,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        logit_bias=logit_bias(body, vocab_size),
        structured=structured,
    )
