"""One OpenAI body -> the engine's requests (one per prompt, each with the request's `n`), in one
pass (`build_request`) whose sections below are its steps, in order. Plain value checks are
pydantic's (server/openai/protocol.py). Every failure is an `APIError` (400, or 404 for the model)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace

from server.api.chat import ToolPlan, chat_prompt_ids, tool_plan
from server.api.disagg_logprobs import GenerationOutputs
from server.api.streams import failed
from server.api.structured import request_constraint
from server.openai.errors import APIError, bad_field
from server.openai.formatting import Echo, FormatOptions
from server.openai.logprobs import pieces_for
from server.openai.protocol import ChatCompletionRequest, CompletionRequest, DisaggParams
from server.types import (
    DEFAULT_RETENTION_PRIORITY,
    EngineClient,
    GenerateRequest,
    RequestOutput,
    SamplingParams,
    StructuredSpec,
)

Body = CompletionRequest | ChatCompletionRequest
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_MAX_N = 16  # choices per prompt (`n`) a server takes unless configured otherwise
GENERATION_ONLY = "generation_only"


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class Prompt:
    token_ids: list[int]
    text: str | None  # as the client sent it (None: sent as token ids)
    param: str  # the field errors about it name


@dataclass(frozen=True)
class Built:
    """What `build_request` made: one engine request per prompt, and how to answer."""

    requests: list[GenerateRequest]
    options: FormatOptions
    transforms: list  # per request: what is done to its outputs before formatting (or None)


def build_request(body: Body, engine: EngineClient, request_id: str, max_n: int = DEFAULT_MAX_N) -> Built:
    check_model(body.model, engine)
    _check_choices(body, max_n)
    logprobs = _output_logprobs(body)
    tokenizer, vocab_size = engine.tokenizer, engine.vocab_size
    chat = isinstance(body, ChatCompletionRequest)
    plan = tool_plan(body, getattr(tokenizer, "chat_template", None)) if chat else ToolPlan()
    if chat:
        prompts = [Prompt(chat_prompt_ids(body, tokenizer, plan.template_tools), None, "messages")]
    else:
        prompts = _completion_prompts(body, tokenizer, vocab_size)
    disagg = _check_disagg(body, vocab_size, len(prompts))
    generation_leg = disagg is not None and disagg.request_type == GENERATION_ONLY
    constraint = request_constraint(body, plan.schema, plan.param, tokenizer)
    echo = not chat and body.echo
    prompt_logprobs = logprobs if echo and not generation_leg else None  # computed where the prompt is
    requests = [_engine_request(body, engine, p, f"{request_id}-{i}" if len(prompts) > 1 else request_id,
                                constraint, logprobs, prompt_logprobs) for i, p in enumerate(prompts)]
    options = FormatOptions(n=body.n, logprobs=logprobs, tools=plan.mode,
                            echo=tuple(_echo(p, r, tokenizer) for p, r in zip(prompts, requests, strict=True))
                            if echo else (),
                            pieces=pieces_for(tokenizer) if logprobs is not None else None)
    return Built(requests, options, _transforms(body, requests, logprobs is not None, echo))


# ---- 1. what needs the server

def check_model(requested: str | None, engine: EngineClient) -> None:
    """A request may omit `model` or name the served model; anything else is a 404."""
    if requested is not None and requested != engine.model_name:
        raise APIError(404, f"model '{requested}' does not exist; this server serves '{engine.model_name}'",
                       param="model", code="model_not_found")


def _check_choices(body: Body, max_n: int) -> None:
    if body.n > max_n:
        raise bad_field("n", f"{body.n} choices asked; this server's maximum is {max_n}")
    best_of = body.best_of if isinstance(body, CompletionRequest) else None
    if best_of is not None and best_of != body.n:
        raise bad_field("best_of", f"must equal n ({body.n}); pdserve does not rank extra candidates")


def _output_logprobs(body: Body) -> int | None:
    """How many alternatives each sampled token's logprob comes with; None: no logprobs."""
    if isinstance(body, ChatCompletionRequest):
        if body.top_logprobs is not None and not body.logprobs:
            raise bad_field("top_logprobs", "needs logprobs: true")
        return (body.top_logprobs or 0) if body.logprobs else None
    return body.logprobs


# ---- 2. the prompt (token ids a request carries must be ids of the model's vocabulary,
# `EngineClient.vocab_size`, which may exceed the tokenizer's)

def _completion_prompts(body: CompletionRequest, tokenizer, vocab_size: int) -> list[Prompt]:
    """A string, token ids, or a list of several of those."""
    prompt = body.prompt
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        named = [("prompt", prompt)]
    else:
        named = [(f"prompt.{i}", p) for i, p in enumerate(prompt)]
    return [Prompt(list(tokenizer.encode(p)), p, param) if isinstance(p, str) and p
            else Prompt(_token_ids(p, vocab_size, param), None, param)  # an empty string is refused there too
            for param, p in named]


def _token_ids(ids: Sequence[int], vocab_size: int, param: str) -> list[int]:
    """A non-empty list of the vocabulary's ids (a prompt)."""
    if not ids:
        raise APIError(400, f"{param} must not be empty", param=param)
    _check_in_vocab(ids, vocab_size, param)
    return list(ids)


def _check_in_vocab(ids: Sequence[int], vocab_size: int, param: str) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} in {param} is outside the vocabulary [0, {vocab_size})", param=param)


# ---- 3. the disaggregated parameters

def _check_disagg(body: Body, vocab_size: int, prompts: int) -> DisaggParams | None:
    """The request's parameters, checked; a context or generation leg carries one prompt."""
    disagg = body.disaggregated_params
    if disagg is None:
        return None
    if disagg.first_text_streamed and (disagg.request_type != GENERATION_ONLY or not body.stream):
        raise APIError(400, "disaggregated_params.first_text_streamed is only for streamed generation_only "
                       "requests (the router sets it when it streamed the first token itself)",
                       param="disaggregated_params.first_text_streamed")
    if disagg.kv_stream and disagg.request_type == GENERATION_ONLY and disagg.first_gen_tokens:
        raise APIError(400, "disaggregated_params.first_gen_tokens: a kv_stream generation_only request takes its "
                       "first token from the KV transfer", param="disaggregated_params.first_gen_tokens")
    if disagg.request_type != "context_and_generation" and prompts > 1:
        raise bad_field("prompt", f"a {disagg.request_type} request carries one prompt, not {prompts}")
    first = disagg.first_gen_tokens
    if first:
        _check_in_vocab(first, vocab_size, "disaggregated_params.first_gen_tokens")
    if first and disagg.request_type == GENERATION_ONLY and len(first) != body.n:
        raise APIError(400, f"disaggregated_params.first_gen_tokens holds {len(first)} tokens; a generation_only "
                       f"request takes one first token per choice (n={body.n})",
                       param="disaggregated_params.first_gen_tokens")
    return disagg


def _prompt_and_prior(prompt_ids: list[int], disagg: DisaggParams | None, vocab_size: int) -> tuple[list[int], int]:
    """The prompt's ids and how many of the last are a moved stream's output (`prior_output_tokens`).
    A leg's `prompt_token_ids` win over re-tokenising: the context server's KV is for exactly those."""
    prior = disagg.prior_output_tokens if disagg is not None else 0
    if disagg is not None and disagg.prompt_token_ids and (disagg.request_type == GENERATION_ONLY or prior):
        prompt_ids = _token_ids(list(disagg.prompt_token_ids), vocab_size, "disaggregated_params.prompt_token_ids")
    if prior >= len(prompt_ids):
        raise APIError(400, "disaggregated_params.prior_output_tokens must be less than the number of "
                       "prompt_token_ids", param="disaggregated_params.prior_output_tokens")
    return prompt_ids, prior


def _cache_salt(salt: str | None, disagg: DisaggParams | None) -> str | None:
    """The salt the prompt's blocks are hashed with. A generation_only request takes the context
    server's (it made the KV this server pulls), which must agree with the body's when both are set."""
    if disagg is None or disagg.request_type != GENERATION_ONLY or disagg.cache_salt is None:
        return salt
    if salt is not None and salt != disagg.cache_salt:
        raise APIError(400, "cache_salt differs from disaggregated_params.cache_salt (the salt the context "
                       "server hashed this prompt with)", param="cache_salt")
    return disagg.cache_salt


def _check_generation_logprobs(disagg: DisaggParams, prompt_len: int, logprobs: bool, echo: bool) -> None:
    """A generation_only request that asks for logprobs brings the context server's."""
    if disagg.first_text_streamed or disagg.kv_stream:
        return  # the router sent the first token's; with streamed KV it comes with the KV
    first = disagg.first_gen_logprobs
    tokens = disagg.first_gen_tokens or ()
    if logprobs and tokens:
        param = "disaggregated_params.first_gen_logprobs"
        if first is None or len(first) != len(tokens) or any(e[0] != t for e, t in zip(first, tokens, strict=False)):
            raise bad_field(param, "logprobs are asked: one entry per first_gen_tokens token, that token's")
    if logprobs and echo and (disagg.prompt_logprobs is None or len(disagg.prompt_logprobs) != prompt_len):
        param = "disaggregated_params.prompt_logprobs"
        raise bad_field(param, "echo with logprobs needs the context server's, one per prompt token")


# ---- 5. sampling, per prompt

def _engine_request(body: Body, engine: EngineClient, prompt: Prompt, request_id: str,
                    constraint: StructuredSpec | None, logprobs: int | None,
                    prompt_logprobs: int | None) -> GenerateRequest:
    disagg = body.disaggregated_params
    prompt_ids, prior = _prompt_and_prior(prompt.token_ids, disagg, engine.vocab_size)
    chat = isinstance(body, ChatCompletionRequest)
    requested = body.requested_max_tokens if chat else 1 if body.max_tokens == 0 else body.max_tokens
    default = None if chat else COMPLETION_DEFAULT_MAX_TOKENS
    # max_tokens and min_tokens count the output a moved stream already produced (`prior`)
    max_tokens = resolve_max_tokens(requested, default, len(prompt_ids) - prior, engine.max_seq_len, prompt.param)
    if max_tokens <= prior:
        raise APIError(400, f"nothing left to generate: {prior} of max_tokens {max_tokens} were produced",
                       param="disaggregated_params.prior_output_tokens")
    sampling = _sampling_params(body, max_tokens, engine.vocab_size, constraint, logprobs, prompt_logprobs)
    if prior:
        sampling = replace(sampling, max_tokens=max_tokens - prior, min_tokens=max(0, sampling.min_tokens - prior))
    priority = body.kv_retention_priority
    return GenerateRequest(request_id=request_id, prompt_token_ids=prompt_ids, sampling=sampling, disagg=disagg,
                           cache_salt=_cache_salt(body.cache_salt, disagg),
                           kv_retention_priority=DEFAULT_RETENTION_PRIORITY if priority is None else priority)


def resolve_max_tokens(requested: int | None, default: int | None, prompt_len: int, max_seq_len: int,
                       prompt_param: str) -> int:
    """The number of tokens to generate; `default` None: up to the context length (chat)."""
    room = max_seq_len - prompt_len
    if room < 1:
        raise APIError(400, f"the prompt has {prompt_len} tokens; this model's maximum context length is "
                       f"{max_seq_len} tokens, which leaves no room to generate", param=prompt_param,
                       code="context_length_exceeded")
    if requested is None:
        return room if default is None else min(default, room)
    if requested > room:
        raise APIError(400, f"this model's maximum context length is {max_seq_len} tokens; you requested "
                       f"{prompt_len + requested} ({prompt_len} in the prompt, {requested} to generate)",
                       param="max_tokens", code="context_length_exceeded")
    return requested


def _sampling_params(body: Body, max_tokens: int, vocab_size: int, constraint: StructuredSpec | None,
                     logprobs: int | None, prompt_logprobs: int | None) -> SamplingParams:
    _check_in_vocab(body.stop_token_ids or (), vocab_size, "stop_token_ids")
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
        logit_bias=_logit_bias(body, vocab_size),
        structured=constraint,
    )


def _logit_bias(body: Body, vocab_size: int) -> tuple[tuple[int, float], ...]:
    out = sorted((int(key), float(bias)) for key, bias in (body.logit_bias or {}).items())
    bad = next((token for token, _ in out if not 0 <= token < vocab_size), None)
    if bad is not None:
        raise bad_field("logit_bias", f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    return tuple(out)


# ---- 6. how to answer

def _echo(prompt: Prompt, request: GenerateRequest, tokenizer) -> Echo:
    ids = request.prompt_token_ids
    text = prompt.text if prompt.text is not None else tokenizer.decode(ids, skip_special_tokens=True)
    return Echo(text, tuple(ids))


def _transforms(body: Body, requests: list[GenerateRequest], logprobs: bool, echo: bool) -> list:
    disagg = requests[0].disagg
    transforms = [None] * len(requests)
    if disagg is not None and disagg.request_type == GENERATION_ONLY:
        prompt_len = len(requests[0].prompt_token_ids) - disagg.prior_output_tokens
        _check_generation_logprobs(disagg, prompt_len, logprobs, echo)
        transforms = [GenerationOutputs(disagg, body.n).apply]
    if isinstance(body, CompletionRequest) and body.max_tokens == 0:
        if not echo or disagg is not None:
            raise bad_field("max_tokens", "0 is only for echo (the prompt's logprobs), not disaggregated")
        transforms = [_zero_tokens] * len(requests)
    return transforms


def _zero_tokens(output: RequestOutput) -> RequestOutput:
    """`echo` with `max_tokens: 0`: the engine generated one token; the answer has none of it."""
    reason = output.finish_reason if failed(output) or not output.finished else "length"
    return replace(output, new_token_ids=[], new_text="", logprobs=None, completion_tokens=0, finish_reason=reason)
