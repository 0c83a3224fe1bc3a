"""Tool-call events (server/openai/json_calls.py) -> OpenAI's shapes: a message's `tool_calls`, and
stream deltas (a call's first delta carries index, id, type and the function's name, arguments "";
the next ones only index and arguments fragments)."""

from __future__ import annotations

import uuid

from server.openai.json_calls import CallArguments, CallStart, Content, Event
from server.openai.responses import ChatDelta, ChatMessageOut, FunctionOut, ToolCallOut


def _started(call: CallStart, index: int | None = None) -> ToolCallOut:
    """A call's first part: its id, type and function name (`index` in stream deltas only)."""
    return ToolCallOut(index=index, id=f"call_{uuid.uuid4().hex[:24]}", type="function",
                       function=FunctionOut(name=call.name, arguments=""))


def stream_deltas(events: list[Event]) -> list[ChatDelta]:
    """One delta per run of content or of one call's arguments."""
    return [_delta(event) for event in _merged(events)]


def _merged(events: list[Event]) -> list[Event]:
    out: list[Event] = []
    for event in events:
        last = out[-1] if out else None
        if isinstance(event, Content) and isinstance(last, Content):
            out[-1] = Content(last.text + event.text)
        elif isinstance(event, CallArguments) and isinstance(last, CallArguments) and last.index == event.index:
            out[-1] = CallArguments(event.index, last.text + event.text)
        else:
            out.append(event)
    return out


def _delta(event: Event) -> ChatDelta:
    if isinstance(event, Content):
        return ChatDelta(content=event.text)
    if isinstance(event, CallStart):
        return ChatDelta(tool_calls=[_started(event, event.index)])
    return ChatDelta(tool_calls=[ToolCallOut(index=event.index, function=FunctionOut(arguments=event.text))])


def tool_message(events: list[Event]) -> ChatMessageOut:
    content = "".join(e.text for e in events if isinstance(e, Content))
    calls: dict[int, ToolCallOut] = {}
    for event in events:
        if isinstance(event, CallStart):
            calls[event.index] = _started(event)
        elif isinstance(event, CallArguments):
            calls[event.index].function.arguments += event.text
    if not calls:
        return ChatMessageOut(content=content)
    return ChatMessageOut(content=content or None, tool_calls=[calls[i] for i in sorted(calls)])
