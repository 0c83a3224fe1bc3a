"""Request body -> `GenerateRequest`: tokenise the prompt, check it against the model, map sampling.

Checks here need the engine (tokenizer, `max_seq_len`, served model name); plain value checks are
pydantic's (`server.openai.protocol`). Every failure is an `APIError` (400, or 404 for the model).
"""

from __future__ import annotations

import uuid
from dataclasses import replace

from jinja2 import TemplateError

from server.api.errors import APIError
from server.openai.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest
from server.types import DEFAULT_RETENTION_PRIORITY, DisaggParams, EngineClient, GenerateRequest, SamplingParams

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def check_model(requested: str | None, engine: EngineClient) -> None:
    """A request may omit `model` or name the served model; anything else is a 404."""
    if requested is not None and requested != engine.model_name:
        raise APIError(404, f"model '{requested}' does not exist; this server serves '{engine.model_name}'",
                       param="model", code="model_not_found")


def completion_prompt_ids(body: CompletionRequest, tokenizer, vocab_size: int) -> list[int]:
    """Token ids of a completions prompt (a string, token ids, or a list holding one of those)."""
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise APIError(400, "batched prompts are not supported: send one prompt per request",
                           param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise APIError(400, "prompt must not be empty", param="prompt")
        return list(tokenizer.encode(prompt))
    return _checked_token_ids(prompt, vocab_size, "prompt")


def _checked_token_ids(ids: list[int], vocab_size: int, param: str) -> list[int]:
    if not ids:
        raise APIError(400, f"{param} must not be empty", param=param)
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} in {param} is outside the vocabulary [0, {vocab_size})",
                       param=param)
    return list(ids)


def _message_text(content, index: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise APIError(400, f"only text content is supported (messages.{index} has '{part.type}')",
                           param=f"messages.{index}.content")
        texts.append(part.text)
    return "".join(texts)


def chat_prompt_ids(body: ChatCompletionRequest, tokenizer) -> list[int]:
    """Render the messages with the tokenizer's chat template (generation prompt added), tokenise."""
    messages = [{"role": m.role, "content": _message_text(m.content, i)} for i, m in enumerate(body.messages)]
    if getattr(tokenizer, "chat_template", None) is None:
        raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions",
                       param="messages")
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except (TemplateError, ValueError) as exc:
        raise APIError(400, f"the chat template refused these messages: {exc}", param="messages") from exc
    # The template already wrote any special tokens (BOS) it wants.
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    if not ids:
        raise APIError(400, "messages render to an empty prompt", param="messages")
    return ids


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


def sampling_params(body: SamplingRequest, max_tokens: int) -> SamplingParams:
    if body.min_tokens > max_tokens:
        raise APIError(400, f"min_tokens ({body.min_tokens}) must not exceed max_tokens ({max_tokens})",
                       param="min_tokens")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=0 if body.top_k is None else body.top_k,
        seed=body.seed,
        stop=body.stop_list,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        min_tokens=body.min_tokens,
        ignore_eos=body.ignore_eos,
    )


def build_request(body: CompletionRequest | ChatCompletionRequest, engine: EngineClient,
                  request_id: str) -> GenerateRequest:
    """Validate `body` against the engine and build the engine's request."""
    check_model(body.model, engine)
    tokenizer = engine.tokenizer
    if isinstance(body, ChatCompletionRequest):
        prompt_ids, param = chat_prompt_ids(body, tokenizer), "messages"
        requested, default = body.requested_max_tokens, None
    else:
        prompt_ids, param = completion_prompt_ids(body, tokenizer, engine.vocab_size), "prompt"
        requested, default = body.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS
    disagg = body.disaggregated_params
    if disagg is not None and disagg.first_text_streamed and (disagg.request_type != "generation_only"
                                                             or not body.stream):
        raise APIError(400, "disaggregated_params.first_text_streamed is only for streamed generation_only "
                       "requests (the router sets it when it streamed the first token itself)",
                       param="disaggregated_params.first_text_streamed")
    if disagg is not None and disagg.kv_stream and disagg.request_type == "generation_only" and disagg.first_gen_tokens:
        raise APIError(400, "disaggregated_params.first_gen_tokens: a kv_stream generation_only request takes its "
                       "first token from the KV transfer", param="disaggregated_params.first_gen_tokens")
    if body.stop_token_ids:
        _checked_token_ids(body.stop_token_ids, engine.vocab_size, "stop_token_ids")
    if disagg is not None and disagg.first_gen_tokens:
        _checked_token_ids(list(disagg.first_gen_tokens), engine.vocab_size, "disaggregated_params.first_gen_tokens")
    prior = disagg.prior_output_tokens if disagg is not None else 0
    if disagg is not None and disagg.prompt_token_ids and (disagg.request_type == "generation_only" or prior):
        # The KV the context server made is for exactly these ids: they win over re-tokenising.
        # A moved stream's context leg (prior > 0) prefills the prompt and the output so far.
        prompt_ids = _checked_token_ids(list(disagg.prompt_token_ids), engine.vocab_size,
                                        "disaggregated_params.prompt_token_ids")
    if prior >= len(prompt_ids):
        raise APIError(400, "disaggregated_params.prior_output_tokens must be less than the number of "
                       "prompt_token_ids", param="disaggregated_params.prior_output_tokens")
    # max_tokens and min_tokens count the output a moved stream already produced (`prior`)
    max_tokens = resolve_max_tokens(requested, default, len(prompt_ids) - prior, engine.max_seq_len, param)
    if max_tokens <= prior:
        raise APIError(400, f"nothing left to generate: {prior} of max_tokens {max_tokens} were produced",
                       param="disaggregated_params.prior_output_tokens")
    sampling = sampling_params(body, max_tokens)
    first = disagg.first_gen_tokens if disagg is not None and disagg.request_type == "generation_only" else None
    if first and len(first) != sampling.n:
        raise APIError(400, f"disaggregated_params.first_gen_tokens holds {len(first)} tokens; a generation_only "
                       f"request takes one first token per choice (n={sampling.n})",
                       param="disaggregated_params.first_gen_tokens")
    if prior:
        sampling = replace(sampling, max_tokens=max_tokens - prior, min_tokens=max(0, sampling.min_tokens - prior))
    priority = body.kv_retention_priority
    return GenerateRequest(request_id=request_id, prompt_token_ids=prompt_ids, sampling=sampling, disagg=disagg,
                           cache_salt=request_cache_salt(body.cache_salt, disagg),
                           kv_retention_priority=DEFAULT_RETENTION_PRIORITY if priority is None else priority)


def request_cache_salt(salt: str | None, disagg: DisaggParams | None) -> str | None:
    """The salt the prompt's blocks are hashed with. A generation_only request takes the context
    server's (it made the KV this server pulls), which must agree with the body's when both are set."""
    if disagg is None or disagg.request_type != "generation_only" or disagg.cache_salt is None:
        return salt
    if salt is not None and salt != disagg.cache_salt:
        raise APIError(400, "cache_salt differs from disaggregated_params.cache_salt (the salt the context "
                       "server hashed this prompt with)", param="cache_salt")
    return disagg.cache_salt
