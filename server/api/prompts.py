"""Request body -> the engine requests and how to format their outputs (`build_request`): one engine
request per prompt, each with the request's `n`. Checks here need the engine (tokenizer, vocabulary,
`max_seq_len`, served model name) or the server's limits; plain value checks are pydantic's
(server/openai/protocol.py). Every failure is an `APIError` (400, or 404 for the model).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, replace

from server.api.chat_template import chat_prompt_ids
from server.api.disagg_logprobs import GenerationOutputs
from server.api.disagg_params import check_disagg, check_generation_params, prompt_and_prior, request_cache_salt
from server.api.errors import APIError
from server.api.sampling import DEFAULT_MAX_N, check_choices, output_logprobs, sampling_params
from server.api.streams import failed
from server.api.structured import checked, request_constraint
from server.api.token_text import pieces_for
from server.api.tool_choice import ToolPlan, tool_plan
from server.api.vocab import token_ids
from server.openai.formatting import Echo, FormatOptions
from server.openai.protocol import ChatCompletionRequest, CompletionRequest
from server.types import DEFAULT_RETENTION_PRIORITY, EngineClient, GenerateRequest, RequestOutput, StructuredSpec

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def check_model(requested: str | None, engine: EngineClient) -> None:
    """A request may omit `model` or name the served model; anything else is a 404."""
    if requested is not None and requested != engine.model_name:
        raise APIError(404, f"model '{requested}' does not exist; this server serves '{engine.model_name}'",
                       param="model", code="model_not_found")


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


def completion_prompts(body: CompletionRequest, tokenizer, vocab_size: int) -> list[Prompt]:
    """A string, token ids, or a list of several of those."""
    prompt = body.prompt
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return [_one_prompt(prompt, tokenizer, vocab_size, "prompt")]
    return [_one_prompt(p, tokenizer, vocab_size, f"prompt.{i}") for i, p in enumerate(prompt)]


def _one_prompt(prompt: str | list[int], tokenizer, vocab_size: int, param: str) -> Prompt:
    if isinstance(prompt, str) and prompt:
        return Prompt(list(tokenizer.encode(prompt)), prompt, param)
    return Prompt(token_ids(prompt, vocab_size, param), None, param)  # an empty string is refused there too


def resolve_max_tokens(requested: int | None, default: int | None, prompt_len: int, max_seq_len: int,
                       prompt_param: str) -> int:
    """The number of tokens to generate; errors name the prompt or `max_tokens`.

    `default` None means "up to the context length" (chat); an explicit request must fit entirely.
    """
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


def _constraint(body, plan: ToolPlan, tokenizer) -> StructuredSpec | None:
    own = request_constraint(body)
    if own is not None and plan.constraint is not None:
        field = own[0].split(".")[0]
        raise APIError(400, f"'{field}': tool_choice constrains the answer to tool calls; it cannot be combined "
                       "with another structured-output constraint", param=field)
    if plan.constraint is not None:
        return checked(plan.constraint, tokenizer, plan.param)
    return checked(own[1], tokenizer, own[0]) if own is not None else None


def build_request(body: CompletionRequest | ChatCompletionRequest, engine: EngineClient, request_id: str,
                  max_n: int = DEFAULT_MAX_N) -> Built:
    """Validate `body` against the engine and build the engine's requests."""
    check_model(body.model, engine)
    check_choices(body, max_n)
    tokenizer = engine.tokenizer
    chat = isinstance(body, ChatCompletionRequest)
    plan = tool_plan(body, getattr(tokenizer, "chat_template", None)) if chat else ToolPlan()
    if chat:
        prompts = [Prompt(chat_prompt_ids(body, tokenizer, plan.template_tools), None, "messages")]
    else:
        prompts = completion_prompts(body, tokenizer, engine.vocab_size)
    disagg = check_disagg(body, engine.vocab_size, len(prompts))
    generation_leg = disagg is not None and disagg.request_type == "generation_only"
    structured = _constraint(body, plan, tokenizer)
    logprobs = output_logprobs(body)
    echo = not chat and body.echo
    prompt_logprobs = logprobs if echo and not generation_leg else None  # computed where the prompt is
    requests = [_engine_request(body, engine, p, f"{request_id}-{i}" if len(prompts) > 1 else request_id,
                                structured, logprobs, prompt_logprobs) for i, p in enumerate(prompts)]
    options = FormatOptions(n=body.n, logprobs=logprobs, tools=plan.mode,
                            echo=tuple(_echo(p, r, tokenizer) for p, r in zip(prompts, requests, strict=True))
                            if echo else (),
                            pieces=pieces_for(tokenizer) if logprobs is not None else None)
    return Built(requests, options, _transforms(body, requests, logprobs is not None, echo))


def _transforms(body: CompletionRequest | ChatCompletionRequest, requests: list[GenerateRequest], logprobs: bool,
                echo: bool) -> list:
    disagg = requests[0].disagg
    transforms = [None] * len(requests)
    if disagg is not None and disagg.request_type == "generation_only":
        check_generation_params(disagg, len(requests[0].prompt_token_ids) - disagg.prior_output_tokens, logprobs, echo)
        transforms = [GenerationOutputs(disagg, body.n).apply]
    if isinstance(body, CompletionRequest) and body.max_tokens == 0:
        if not echo or disagg is not None:
            raise APIError(400, "'max_tokens': 0 is only for echo (the prompt's logprobs), not disaggregated",
                           param="max_tokens")
        transforms = [_zero_tokens] * len(requests)
    return transforms


def _echo(prompt: Prompt, request: GenerateRequest, tokenizer) -> Echo:
    ids = request.prompt_token_ids
    text = prompt.text if prompt.text is not None else tokenizer.decode(ids, skip_special_tokens=True)
    return Echo(text, tuple(ids))


def _engine_request(body, engine: EngineClient, prompt: Prompt, request_id: str, structured: StructuredSpec | None,
                    logprobs: int | None, prompt_logprobs: int | None) -> GenerateRequest:
    disagg = body.disaggregated_params
    prompt_ids, prior = prompt_and_prior(prompt.token_ids, disagg, engine.vocab_size)
    chat = isinstance(body, ChatCompletionRequest)
    requested = body.requested_max_tokens if chat else 1 if body.max_tokens == 0 else body.max_tokens
    default = None if chat else COMPLETION_DEFAULT_MAX_TOKENS
    # max_tokens and min_tokens count the output a moved stream already produced (`prior`)
    max_tokens = resolve_max_tokens(requested, default, len(prompt_ids) - prior, engine.max_seq_len, prompt.param)
    if max_tokens <= prior:
        raise APIError(400, f"nothing left to generate: {prior} of max_tokens {max_tokens} were produced",
                       param="disaggregated_params.prior_output_tokens")
    sampling = sampling_params(body, max_tokens, engine.vocab_size, structured=structured, logprobs=logprobs,
                               prompt_logprobs=prompt_logprobs)
    if prior:
        sampling = replace(sampling, max_tokens=max_tokens - prior, min_tokens=max(0, sampling.min_tokens - prior))
    priority = body.kv_retention_priority
    return GenerateRequest(request_id=request_id, prompt_token_ids=prompt_ids, sampling=sampling, disagg=disagg,
                           cache_salt=request_cache_salt(body.cache_salt, disagg),
                           kv_retention_priority=DEFAULT_RETENTION_PRIORITY if priority is None else priority)


def _zero_tokens(output: RequestOutput) -> RequestOutput:
    """`echo` with `max_tokens: 0`: the engine generates one token (it cannot do fewer); the answer
    has none of it, only the prompt and its logprobs."""
    reason = output.finish_reason if failed(output) or not output.finished else "length"
    return replace(output, new_token_ids=[], new_text="", logprobs=None, completion_tokens=0, finish_reason=reason)
