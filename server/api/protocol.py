"""OpenAI request and response bodies for /v1/completions and /v1/chat/completions (pydantic v2).

Requests accept OpenAI's fields plus vLLM's extras (`ignore_eos`, `min_tokens`, `top_k`,
`stop_token_ids`, `cache_salt`), a KV retention priority (`kv_retention_priority`, TensorRT-LLM's
`KvCacheRetentionConfig` priority) and TensorRT-LLM's `disaggregated_params`; unknown fields are
ignored. Value checks
that need no model (ranges, `n`) live here; checks that need the tokenizer or `max_seq_len` live in
`server.api.prompts`. Any validation failure becomes a 400 (see `server.api.errors`).
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
from pydantic_core import PydanticCustomError

from server.types import DisaggParams, RequestType

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


class DisaggregatedParams(BaseModel):
    """TensorRT-LLM's `disaggregated_params` (the fields pdserve uses); maps to `DisaggParams`."""

    model_config = ConfigDict(extra="ignore", coerce_numbers_to_str=True)  # TRT-LLM sends int ids
    request_type: RequestType
    ctx_request_id: str | None = None
    ctx_endpoint: str | None = None
    ctx_epoch: str | None = None
    first_gen_tokens: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    ctx_cached_tokens: int = Field(default=0, ge=0)
    first_text_streamed: bool = Field(default=False, exclude=True)  # request only: the router streamed the first text
    cache_salt: str | None = None  # the context server's: the generation server hashes with it too
    # request only, set by the router when it moves a stream to another server (server/types.py)
    prior_output_tokens: int = Field(default=0, ge=0, exclude=True)
    response_id: str | None = Field(default=None, exclude=True)
    report_tokens: bool = Field(default=False, exclude=True)

    def to_internal(self) -> DisaggParams:
        return DisaggParams(
            request_type=self.request_type,
            ctx_request_id=self.ctx_request_id,
            ctx_endpoint=self.ctx_endpoint,
            ctx_epoch=self.ctx_epoch,
            first_gen_tokens=_tuple_or_none(self.first_gen_tokens),
            prompt_token_ids=_tuple_or_none(self.prompt_token_ids),
            ctx_cached_tokens=self.ctx_cached_tokens,
            first_text_streamed=self.first_text_streamed,
            cache_salt=self.cache_salt,
            prior_output_tokens=self.prior_output_tokens,
            response_id=self.response_id,
            report_tokens=self.report_tokens,
        )

    @classmethod
    def from_internal(cls, params: DisaggParams) -> DisaggregatedParams:
        return cls(
            request_type=params.request_type,
            ctx_request_id=params.ctx_request_id,
            ctx_endpoint=params.ctx_endpoint,
            ctx_epoch=params.ctx_epoch,
            first_gen_tokens=_list_or_none(params.first_gen_tokens),
            prompt_token_ids=_list_or_none(params.prompt_token_ids),
            ctx_cached_tokens=params.ctx_cached_tokens,
            first_text_streamed=params.first_text_streamed,
            cache_salt=params.cache_salt,
        )


def _tuple_or_none(values: list[int] | None) -> tuple[int, ...] | None:
    return None if values is None else tuple(values)


def _list_or_none(values: tuple[int, ...] | None) -> list[int] | None:
    return None if values is None else list(values)


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
    disaggregated_params: DisaggregatedParams | None = None

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
    disaggregated_params: DisaggregatedParams | None = None


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
    disaggregated_params: DisaggregatedParams | None = None


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
    disaggregated_params: DisaggregatedParams | None = None


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
