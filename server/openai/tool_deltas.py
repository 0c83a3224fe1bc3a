"""Tool-call events (server/openai/json_calls.py) -> OpenAI's shapes: a message's `tool_calls`, and
stream deltas (a call's first delta carries index, id, type and the function's name, arguments "";
the next ones only index and arguments fragments)."""

from __future__ import annotations

import uuid

from server.openai.json_calls import CallArguments, CallStart, Content, Event
from server.openai.responses import ChatDelta, ChatMessageOut, FunctionOut, ToolCallOut


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def event_delta(event: Event, call_ids: dict[int, str]) -> ChatDelta:
    """The delta of one event; `call_ids` keeps each call's id (made at its start)."""
    if isinstance(event, Content):
        return ChatDelta(content=event.text)
    if isinstance(event, CallStart):
        call_ids[event.index] = new_call_id()
        call = ToolCallOut(index=event.index, id=call_ids[event.index], type="function",
                           function=FunctionOut(name=event.name, arguments=""))
    else:
        call = ToolCallOut(index=event.index, function=FunctionOut(arguments=event.text))
    return ChatDelta(tool_calls=[call])


def tool_message(events: list[Event]) -> ChatMessageOut:
    content = "".join(e.text for e in events if isinstance(e, Content))
    calls: dict[int, ToolCallOut] = {}
    for event in events:
        if isinstance(event, CallStart):
            calls[event.index] = ToolCallOut(id=new_call_id(), type="function",
                                             function=FunctionOut(name=event.name, arguments=""))
        elif isinstance(event, CallArguments):
            calls[event.index].function.arguments += event.text
    if not calls:
        return ChatMessageOut(content=content)
    return ChatMessageOut(content=content or None, tool_calls=[calls[i] for i in sorted(calls)])


def extends(before: ChatDelta, delta: ChatDelta) -> bool:
    """`delta` continues `before`: more content, or more arguments of the same call."""
    if before.content is not None and delta.content is not None:
        return True
    if before.tool_calls and delta.tool_calls and delta.tool_calls[0].id is None:
        return before.tool_calls[-1].index == delta.tool_calls[0].index and before.tool_calls[-1].id is None
    return False


def joined(before: ChatDelta, delta: ChatDelta) -> ChatDelta:
    if before.content is not None:
        return ChatDelta(content=before.content + delta.content)
    call = before.tool_calls[-1]
    more = FunctionOut(arguments=(call.function.arguments or "") + (delta.tool_calls[0].function.arguments or ""))
    return ChatDelta(tool_calls=[ToolCallOut(index=call.index, function=more)])
