"""A context server's answer, read by the router: whether it ends the request, the generation leg's
parameters, and the events the router streams itself from it (a stream's opening, or its close).

Streaming the first token from the context answer takes the generation leg's setup off the time to
first token. The context server reports exactly the text the generation server would stream for
that token (a possible stop string or incomplete UTF-8 stays held back), so the two parts join
without a gap or a repeat."""

from __future__ import annotations

from collections.abc import AsyncIterator

from server.openai.formatting import continued_response_id
from server.openai.protocol import DISAGG_PARAMS, DisaggParams
from server.openai.responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    CompletionChoice,
    CompletionResponse,
    ToolCallOut,
)
from server.openai.sse import DONE, EventStream, json_event, sse_event
from server.openai.wire import JSONBody


def context_params(ctx: dict) -> DisaggParams:
    """The `disaggregated_params` of an unfinished context answer."""
    return DISAGG_PARAMS.validate_python(ctx["choices"][0]["disaggregated_params"])


def context_finished(ctx: dict) -> bool:
    """The context answer is final when it carries no parameters for a generation leg."""
    choices = ctx.get("choices") or [{}]
    params = choices[0].get("disaggregated_params") or {}
    return not params.get("ctx_request_id")


def final_answer(ctx: dict, chat: bool, stream: bool, include_usage: bool) -> JSONBody | EventStream:
    """The client's answer when the context leg ended the request (JSON, or a whole stream)."""
    for choice in ctx.get("choices", []):
        choice["disaggregated_params"] = None  # the lease's parameters are the router's own business
    if not stream:
        return JSONBody(ctx)
    return EventStream(_each(closing_events(ctx, chat, ctx.get("id") or "", include_usage)))


async def _each(events: list[bytes]) -> AsyncIterator[bytes]:
    for event in events:
        yield event


def opening_events(ctx: dict, chat: bool, response_id: str | None = None, continued: bool = False) -> list[bytes]:
    """The stream's first events from an unfinished context answer (the chat role chunk, the first
    token's text), under the id the generation server will use too; a moved stream keeps its own id."""
    response_id = response_id or continued_response_id(ctx["choices"][0]["disaggregated_params"]["ctx_request_id"])
    return _chunks(ctx, chat, response_id, continued, finished=False)


def closing_events(ctx: dict, chat: bool, response_id: str, include_usage: bool,
                   continued: bool = False) -> list[bytes]:
    """The rest of a stream the context answer ended: final chunks, usage if asked, [DONE];
    `continued`: in a stream that is already open (a moved one)."""
    usage = {"id": response_id, "object": "chat.completion.chunk" if chat else "text_completion",
             "created": ctx.get("created"), "model": ctx.get("model") or "", "choices": [], "usage": ctx.get("usage")}
    return [*_chunks(ctx, chat, response_id, continued, finished=True), *([json_event(usage)] if include_usage else []),
            DONE]


def _chunks(ctx: dict, chat: bool, response_id: str, continued: bool, finished: bool) -> list[bytes]:
    body = ChatCompletionChunk if chat else CompletionResponse
    out = []
    for choice in ctx.get("choices") or []:
        choice = {k: v for k, v in choice.items() if k != "disaggregated_params"}
        if chat:
            out += _chat_chunks(ChatChoice.model_validate(choice), continued, finished)
        else:
            chunk = CompletionChoice.model_validate(choice)
            chunk.finish_reason = chunk.finish_reason if finished else None
            if finished or chunk.text or chunk.logprobs is not None:
                out.append(chunk)
    return [sse_event(body(id=response_id, model=ctx.get("model") or "", choices=[c]).model_dump_json()) for c in out]


def _chat_chunks(choice: ChatChoice, continued: bool, finished: bool) -> list[ChatChunkChoice]:
    out = [] if continued else [ChatChunkChoice(index=choice.index, delta=ChatDelta(role="assistant", content=""))]
    message = choice.message
    calls = [ToolCallOut(index=i, id=c.id, type=c.type, function=c.function)
             for i, c in enumerate(message.tool_calls or [])] or None
    delta = ChatDelta(content=message.content or None, tool_calls=calls)
    if finished or delta.content or calls or choice.logprobs is not None:
        out.append(ChatChunkChoice(index=choice.index, delta=delta, logprobs=choice.logprobs,
                                   finish_reason=choice.finish_reason if finished else None))
    return out

