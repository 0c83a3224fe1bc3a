"""OpenAI response bodies and stream chunks for completions and chat, and /v1/models (pydantic v2),
in the `openai` package's shapes: tests/unit/test_api_logprobs.py, test_api_tools.py and
test_api_choices.py parse ours back with its models.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field, model_serializer

from server.openai.protocol import DisaggParams


def now() -> int:
    return int(time.time())


class _SkipNone(BaseModel):
    """Only the fields present are sent (OpenAI's deltas and tool calls omit absent ones)."""

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict:
        return {k: v for k, v in handler(self).items() if v is not None}


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class _Body(BaseModel):
    """A response or stream chunk; each kind sets its `object` and the type of its choices."""

    id: str
    object: str
    created: int = Field(default_factory=now)
    model: str
    choices: list[Any]
    usage: Usage | None = None


class CompletionLogprobs(BaseModel):
    """Legacy completions' log-probabilities, one entry per token (an echoed prompt's first: null)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]  # where each token's text starts in the choice's text


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    disaggregated_params: DisaggParams | None = None


class CompletionResponse(_Body):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobOut(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobOut] | None


class FunctionOut(_SkipNone):
    name: str | None = None
    arguments: str | None = None


class ToolCallOut(_SkipNone):
    """A tool call in a message (every field set) or in a delta (the first of a call has index, id,
    type and the function's name; the next ones only index and arguments)."""

    index: int | None = None  # deltas only
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionOut


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # null when the message is only tool calls
    tool_calls: list[ToolCallOut] | None = Field(default=None, exclude_if=lambda calls: calls is None)  # none: left out


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    disaggregated_params: DisaggParams | None = None


class ChatCompletionResponse(_Body):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class ChatDelta(_SkipNone):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    disaggregated_params: DisaggParams | None = None


class ChatCompletionChunk(_Body):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "pdserve"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
