"""Engine outputs -> OpenAI JSON, for completions and chat, whole responses and stream chunks.

The servers format every output with these, and the router the text it streams itself (the first
token of a context answer, the last of a moved stream: server/router/answers.py), so both write
the same chunks. Both formatters have the same surface:
`chunks(output) -> list[str]` (JSON of the stream chunks for one engine output, possibly none),
`usage_chunk(final) -> str`, `response(text, final) -> str` (a whole non-streaming body).
The concatenation of every chunk's text equals the non-streaming text (both are the outputs' `new_text`).
"""

from __future__ import annotations

import hashlib

from server.openai.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessageOut,
    CompletionChoice,
    CompletionResponse,
    PromptTokensDetails,
    Usage,
)
from server.types import RequestOutput


def continued_response_id(ctx_request_id: str) -> str:
    """The id of a stream the router opened from a context answer and a generation server continues:
    derived from the context request id, not equal to it (that id is the key of the KV lease)."""
    prefix = ctx_request_id.split("-", 1)[0] if "-" in ctx_request_id else "cmpl"
    return f"{prefix}-{hashlib.blake2b(ctx_request_id.encode(), digest_size=16).hexdigest()}"


def usage_of(final: RequestOutput) -> Usage:
    return Usage(
        prompt_tokens=final.prompt_tokens,
        completion_tokens=final.completion_tokens,
        total_tokens=final.prompt_tokens + final.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=final.cached_tokens),
    )


def _finish(output: RequestOutput) -> str | None:
    return output.finish_reason if output.finished else None


class CompletionFormatter:
    """`continued`: someone else (the router) opened this stream; only chat needs to know."""

    def __init__(self, response_id: str, model: str, include_usage: bool = False, continued: bool = False):
        self.response_id = response_id
        self.model = model
        self.include_usage = include_usage

    def chunks(self, output: RequestOutput) -> list[str]:
        if not output.new_text and not output.finished:
            return []  # tokens without text yet (an incomplete UTF-8 sequence)
        choice = CompletionChoice(text=output.new_text, finish_reason=_finish(output),
                                  disaggregated_params=output.disagg)
        return [CompletionResponse(id=self.response_id, model=self.model, choices=[choice]).model_dump_json()]

    def usage_chunk(self, final: RequestOutput) -> str:
        body = CompletionResponse(id=self.response_id, model=self.model, choices=[], usage=usage_of(final))
        return body.model_dump_json()

    def response(self, text: str, final: RequestOutput) -> str:
        choice = CompletionChoice(text=text, finish_reason=final.finish_reason,
                                  disaggregated_params=final.disagg)
        body = CompletionResponse(id=self.response_id, model=self.model, choices=[choice],
                                  usage=usage_of(final))
        return body.model_dump_json()


class ChatFormatter:
    """Chat chunks: the first carries `role`, the last `finish_reason` (OpenAI's delta shape).
    `continued`: the router already sent the role chunk."""

    def __init__(self, response_id: str, model: str, include_usage: bool = False, continued: bool = False):
        self.response_id = response_id
        self.model = model
        self.include_usage = include_usage
        self._role_sent = continued

    def _chunk(self, delta: ChatDelta, output: RequestOutput | None) -> str:
        choice = ChatChunkChoice(delta=delta)
        if output is not None:
            choice.finish_reason = _finish(output)
            choice.disaggregated_params = output.disagg
        return ChatCompletionChunk(id=self.response_id, model=self.model, choices=[choice]).model_dump_json()

    def chunks(self, output: RequestOutput) -> list[str]:
        out = []
        if not self._role_sent:
            self._role_sent = True
            out.append(self._chunk(ChatDelta(role="assistant", content=""), None))
        if output.new_text or output.finished:
            out.append(self._chunk(ChatDelta(content=output.new_text or None), output))
        return out

    def usage_chunk(self, final: RequestOutput) -> str:
        body = ChatCompletionChunk(id=self.response_id, model=self.model, choices=[], usage=usage_of(final))
        return body.model_dump_json()

    def response(self, text: str, final: RequestOutput) -> str:
        choice = ChatChoice(message=ChatMessageOut(content=text), finish_reason=final.finish_reason,
                            disaggregated_params=final.disagg)
        body = ChatCompletionResponse(id=self.response_id, model=self.model, choices=[choice],
                                      usage=usage_of(final))
        return body.model_dump_json()


Formatter = CompletionFormatter | ChatFormatter
