"""A context server's answer, read by the router: whether it ends the request, the generation leg's
parameters, and the events the router streams itself from it (the opening of a stream: the chat
role chunk and the first token's text; the close of a stream that the context leg ended).

Streaming the first token from the context answer takes the generation leg's setup (an HTTP
exchange, the generation server's admission) off the time to first token. The generation server
is told so (`first_text_streamed`) and streams only what follows, under the same response id. The
context server reports exactly the text the generation server would stream for that token (text
that might still become a stop string, or an incomplete UTF-8 character, stays held back), so the
two parts join without a gap or a repeat."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace

from pydantic import TypeAdapter

from server.openai.formatting import ChatFormatter, CompletionFormatter, Formatter, continued_response_id
from server.openai.protocol import DisaggParams
from server.openai.sse import DONE, EventStream, sse_event
from server.openai.wire import JSONBody
from server.types import RequestOutput

_PARAMS = TypeAdapter(DisaggParams)


def context_params(ctx: dict) -> DisaggParams:
    """The `disaggregated_params` of an unfinished context answer."""
    return _PARAMS.validate_python(ctx["choices"][0]["disaggregated_params"])


def context_finished(ctx: dict) -> bool:
    """The context answer is final when it carries no parameters for a generation leg."""
    choices = ctx.get("choices") or [{}]
    params = choices[0].get("disaggregated_params") or {}
    return not params.get("ctx_request_id")


def final_answer(ctx: dict, chat: bool, stream: bool, include_usage: bool) -> JSONBody | EventStream:
    """The client's answer when the context leg ended the request: the context answer as it is, or
    as a whole stream."""
    for choice in ctx.get("choices", []):
        choice.pop("disaggregated_params", None)
    if not stream:
        return JSONBody(ctx)
    return EventStream(_each(closing_events(ctx, chat, ctx.get("id") or "", include_usage)))


async def _each(events: list[bytes]) -> AsyncIterator[bytes]:
    for event in events:
        yield event


def opening_events(ctx: dict, chat: bool, response_id: str | None = None, continued: bool = False) -> list[bytes]:
    """The stream's first events from an unfinished context answer: the chat role chunk and the
    first token's text (none when that text is still held back), under the id the generation server
    will use too (`continued_response_id`), with the same formatters the servers use. A moved stream
    (`continued`) goes on under its own `response_id` and sends no second role chunk."""
    response_id = response_id or continued_response_id(ctx["choices"][0]["disaggregated_params"]["ctx_request_id"])
    fmt, output = _as_output(ctx, chat, response_id, continued, finished=False)
    return [sse_event(data) for data in fmt.chunks(output)]


def closing_events(ctx: dict, chat: bool, response_id: str, include_usage: bool,
                   continued: bool = False) -> list[bytes]:
    """The rest of a stream whose request the context answer `ctx` ended: its final chunk, usage if
    asked, [DONE]; `continued`: in a stream that is already open (a moved one)."""
    fmt, final = _as_output(ctx, chat, response_id, continued, finished=True, include_usage=include_usage)
    usage = [fmt.usage_chunk(final)] if include_usage else []
    return [*(sse_event(data) for data in [*fmt.chunks(final), *usage]), DONE]


def _as_output(ctx: dict, chat: bool, response_id: str, continued: bool, finished: bool,
               include_usage: bool = False) -> tuple[Formatter, RequestOutput]:
    """A context answer as the engine output the servers would format, and their formatter."""
    choice = ctx["choices"][0]
    text = ((choice.get("message") or {}).get("content") if chat else choice.get("text")) or ""
    usage = ctx.get("usage") or {}
    output = RequestOutput(response_id, [], text, finished=finished,
                           finish_reason=choice.get("finish_reason") if finished else None,
                           prompt_tokens=usage.get("prompt_tokens", 0),
                           completion_tokens=usage.get("completion_tokens", 0),
                           cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
    fmt = (ChatFormatter if chat else CompletionFormatter)(response_id, ctx.get("model") or "", include_usage,
                                                           continued=continued)
    return fmt, output


def generation_params(ctx: dict, first_text_streamed: bool) -> DisaggParams:
    """The generation leg's parameters: the context answer's, as a generation_only request."""
    return replace(context_params(ctx), request_type="generation_only", first_text_streamed=first_text_streamed)
