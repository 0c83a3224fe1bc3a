"""OpenAI request and response bodies for /v1/completions and /v1/chat/completions (pydantic v2).

Requests accept OpenAI's fields plus vLLM's extras (`ignore_eos`, `min_tokens`, `top_k`,
`stop_token_ids`, `cache_salt`), a KV retention priority (`kv_retention_priority`, TensorRT-LLM's
`KvCacheRetentionConfig` priority) and TensorRT-LLM's `disaggregated_params`; unknown fields are
ignored. Value checks
that need no model (ranges, `n`) live here; checks that need the tokenizer or `max_seq_len` live in
`server.api.prompts`. Any validation failure becomes a 400 (see `server.api.errors`). The router
reads only `DisaggParams` of these; it passes the rest of a body on as it came.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    field_validator,
    model_serializer,
)
from pydantic.dataclasses import dataclass
from pydantic_core import PydanticCustomError

_IGNORE_EXTRA = ConfigDict(extra="ignore")


def _one_of(expected: str) -> WrapValidator:
    """Replace pydantic's one-error-per-union-member report by one message naming what is accepted."""

    def validate(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("wrong_type", f"must be {expected}") from None

    return WrapValidator(validate)


class StreamOptions(BaseModel):
    model_config = _IGNORE_EXTRA
    include_usage: bool = False


RequestType = Literal["context_only", "generation_only", "context_and_generation"]


def _unset(value: Any) -> bool:
    return not value


@dataclass(frozen=True, config=ConfigDict(extra="ignore", coerce_numbers_to_str=True))  # TRT-LLM sends int ids
class DisaggParams:
    """TensorRT-LLM's `disaggregated_params` (the fields pdserve uses): the one shape the router sends,
    the API validates, the engine reads and the context server answers with."""

    request_type: RequestType
    ctx_request_id: str | None = None
    ctx_endpoint: str | None = None
    ctx_epoch: str | None = None
    first_gen_tokens: tuple[int, ...] | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    ctx_cached_tokens: int = Field(default=0, ge=0)  # prefix-cache hit on the context server (honest usage)
    # Set by the router on requests only (left out of a body while unset), but cache_salt:
    # generation_only: the router already streamed the text of first_gen_tokens (and a chat role
    # chunk) under the id continued_response_id(ctx_request_id); stream only what follows, under it
    first_text_streamed: bool = Field(default=False, exclude_if=_unset)
    # the cache_salt the context server hashed the prompt's blocks with: the generation server
    # reuses its own cache, and pulls, under the same one
    cache_salt: str | None = None
    # Migration (the router moves a stream whose generation server died, server/router/migration.py):
    # the last `prior_output_tokens` prompt tokens are the request's output so far, their text already
    # streamed; max_tokens/min_tokens count them, text and usage are reported relative to them.
    prior_output_tokens: int = Field(default=0, ge=0, exclude_if=_unset)
    response_id: str | None = Field(default=None, exclude_if=_unset)  # generation_only: the stream to continue
    report_tokens: bool = Field(default=False, exclude_if=_unset)  # streamed: token ids in an SSE comment
    # KV streamed while the prompt is prefilled (server/api/context_stream.py). context_only: the router
    # takes the early answer (the lease before the first token); the context server decides. generation_only:
    # the pull starts at once, and the first token (no first_gen_tokens) comes with the last of the KV.
    kv_stream: bool = Field(default=False, exclude_if=_unset)


class SamplingRequest(BaseModel):
    """Fields shared by completions and chat requests."""

    model_config = _IGNORE_EXTRA
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = 1
    seed: int | None = None
    stop: Annotated[str | list[str] | None, _one_of("a string or a list of strings")] = None
    max_tokens: int | None = Field(default=None, ge=1)
    # vLLM extras
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    top_k: int | None = Field(default=None, ge=-1)
    stop_token_ids: list[int] | None = None
    # vLLM's prefix-cache namespace: requests share cached blocks only under equal salts
    cache_salt: str | None = None
    # retention priority of the request's KV blocks: 0..100, evicted lowest first; evicted blocks of
    # priority >= kv_cache_config.secondary_offload_min_priority go to the host tier. Default 35.
    kv_retention_priority: int | None = Field(default=None, ge=0, le=100)
    # TensorRT-LLM's disaggregation extension
    disaggregated_params: DisaggParams | None = None

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, n: int) -> int:
        if n > 1:
            raise ValueError("n > 1 is not supported by pdserve (one choice per request)")
        if n < 1:
            raise ValueError("n must be 1")
        return n

    @field_validator("cache_salt")
    @classmethod
    def _salt_not_empty(cls, salt: str | None) -> str | None:
        if salt is not None and not salt:
            raise ValueError("cache_salt must be a non-empty string if provided")
        return salt

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(SamplingRequest):
    # A string or token ids; a list of one of those is accepted (a batch of several is refused).
    prompt: Annotated[str | list[int] | list[str] | list[list[int]],
                      _one_of("a string, a list of token ids, or a list holding one of those")]


class TextPart(BaseModel):
    model_config = _IGNORE_EXTRA
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = _IGNORE_EXTRA
    role: str
    content: Annotated[str | list[TextPart] | None, _one_of("a string or a list of text parts")] = None
    name: str | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    @property
    def requested_max_tokens(self) -> int | None:
        """`max_completion_tokens` (the newer name) wins over `max_tokens`."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# -- responses ----------------------------------------------------------------------------------------


def now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None
    disaggregated_params: DisaggParams | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: None = None
    finish_reason: str | None = None
    disaggregated_params: DisaggParams | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class ChatDelta(BaseModel):
    """Only the fields present are sent (OpenAI's deltas omit absent ones)."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: None = None
    finish_reason: str | None = None
    disaggregated_params: DisaggParams | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "pdserve"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
