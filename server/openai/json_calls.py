"""Tool calls written as JSON objects, read incrementally: `{"name": ..., "arguments": {...}}`.

`CallObject` yields `CallStart` once its head is read, then `CallArguments` fragments as the model
writes them. An object with its keys in another order is announced when it closes; one that is no
call yields nothing (`valid` False)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    name: str


@dataclass(frozen=True)
class CallArguments:
    index: int
    text: str


Event = Content | CallStart | CallArguments

_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)')
_ENDS_PRIMITIVE = ',]} \t\r\n'


class _Span:
    """Where a JSON value that starts at `start` ends, scanned incrementally (`end` None until complete)."""

    def __init__(self, start: int) -> None:
        self.start = self.pos = start
        self.depth, self.in_string, self.escaped = 0, False, False
        self.end: int | None = None

    def advance(self, text: str) -> int | None:
        while self.end is None and self.pos < len(text):
            c = text[self.pos]
            self.pos += 1
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
                    if self.depth == 0:
                        self.end = self.pos
            elif self.depth == 0 and c in _ENDS_PRIMITIVE and self.pos - 1 > self.start:
                self.end = self.pos - 1  # a number or literal ends before this character
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    self.end = self.pos
        return self.end


class CallObject:
    """One call's JSON object, fed from its "{" on. `feed` returns the text after the object once it closed."""

    def __init__(self, index: int) -> None:
        self.index = index  # the call's index if it turns out to be one
        self.text = ""
        self.name: str | None = None  # announced (CallStart sent)
        self._object = _Span(0)
        self._args: _Span | None = None
        self._sent = 0

    @property
    def closed(self) -> bool:
        return self._object.end is not None

    @property
    def valid(self) -> bool:
        """Closed, and a call."""
        return self.closed and self.name is not None

    def feed(self, text: str) -> tuple[list[Event], str]:
        self.text += text
        end = self._object.advance(self.text)
        if end is None:
            return self._announce(), ""
        rest, self.text = self.text[end:], self.text[:end]
        return self._announce() + self._close(), rest

    def _announce(self) -> list[Event]:
        events: list[Event] = []
        if self.name is None:
            head = _HEAD.match(self.text)
            if head is None:
                return events
            self.name = json.loads(f'"{head.group(1)}"')
            self._args = _Span(head.end())
            events.append(CallStart(self.index, self.name))
        return events + self._arguments()

    def _arguments(self) -> list[Event]:
        end = self._args.advance(self.text)
        value = self.text[self._args.start: len(self.text) if end is None else end]
        fresh, self._sent = value[self._sent:], len(value)
        return [CallArguments(self.index, fresh)] if fresh else []

    def _close(self) -> list[Event]:
        """An object not announced yet may be a call with its keys in another order."""
        call = as_call(self.text) if self.name is None else None
        if call is None:
            return []
        self.name = call[0]
        return [CallStart(self.index, call[0]), CallArguments(self.index, call[1])]


def as_call(text: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of a whole call object in any key order; None if it is no call."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters"))
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)
