"""Model output -> tool calls, fed piece by piece as the text streams in (formats: docs/API.md).

Every parser has `feed(text) -> events` and `finish() -> events`; the concatenated events are the
same however the text was split, so streamed tool calls equal non-streamed ones.

Tool calls written as JSON objects, `{"name": ..., "arguments": {...}}`, are read incrementally:
`CallObject` yields `CallStart` once its head is read, then `CallArguments` fragments as the model
writes them. An object with its keys in another order is announced when it closes; one that is no
call yields nothing (`valid` False)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Protocol


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


PYTHON_TAG = "<|python_tag|>"


class ToolParser(Protocol):
    calls: int  # calls announced so far

    def feed(self, text: str) -> list[Event]: ...

    def finish(self) -> list[Event]: ...


def _partial_tail(text: str, tag: str) -> int:
    """Length of the longest end of `text` that could begin `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class _Calls:
    """What the JSON-object formats share: the text not read yet, the call being read, the count of
    calls, and content whose trailing whitespace waits to see whether a call follows (then it is
    dropped). A format's `_step()` reads what it can of the text: events, or None when it needs more.
    Without `parallel` (`parallel_tool_calls: false`) the events of calls after the first are dropped."""

    _opening: str | None = ""  # what an object that is no call is content after (None: it is dropped)

    def __init__(self, parallel: bool = True) -> None:
        self.calls = 0
        self._parallel = parallel
        self._buf = ""
        self._call: CallObject | None = None
        self._space = ""

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        events: list[Event] = []
        while self._buf and (step := self._step()) is not None:
            events += step
        return self._kept(events)

    def finish(self) -> list[Event]:
        """The text not read yet; an announced call keeps what it has, an object cut before it was one
        is content; whitespace at the end stays only in an answer without calls."""
        events = self._rest()
        self._buf = ""
        call, self._call = self._call, None
        if call is not None and call.name is None and self._opening is not None:
            events += self._content(self._opening + call.text)
        space, self._space = self._space, ""
        if space and not self.calls:
            events.append(Content(space))
        return self._kept(events)

    def _kept(self, events: list[Event]) -> list[Event]:
        return events if self._parallel else [e for e in events if isinstance(e, Content) or e.index == 0]

    def _step(self) -> list[Event] | None:
        raise NotImplementedError

    def _rest(self) -> list[Event]:
        """At the end: the content of the text not read yet."""
        return []

    def _content(self, text: str) -> list[Event]:
        text = self._space + text
        body = text.rstrip()
        self._space = text[len(body):]
        return [Content(body)] if body else []

    def _open_call(self, text: str) -> None:
        """`text` begins a JSON object (its "{")."""
        self._space = ""
        self._call = CallObject(self.calls)
        self._buf = text

    def _read_call(self) -> tuple[list[Event], bool | None]:
        """Feeds the text to the open call: (events, None while it is open, else whether it was a call)."""
        events, self._buf = self._call.feed(self._buf)
        self.calls += any(isinstance(e, CallStart) for e in events)
        if not self._call.closed:
            return events, None
        call, self._call = self._call, None
        if not call.valid and self._opening is not None:
            events += self._content(self._opening + call.text)
        return events, call.valid


class HermesParser(_Calls):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _opening = OPEN

    def __init__(self, parallel: bool = True) -> None:
        super().__init__(parallel)
        self._state = self._in_text  # _in_text | _after_open | _in_call | _after_call

    def _step(self) -> list[Event] | None:
        return self._state()

    def _in_text(self) -> list[Event] | None:
        at = self._buf.find(self.OPEN)
        if at < 0:
            cut = len(self._buf) - _partial_tail(self._buf, self.OPEN)
            out, self._buf = self._buf[:cut], self._buf[cut:]
            return self._content(out) if out else None
        events = self._content(self._buf[:at])
        self._buf, self._state = self._buf[at + len(self.OPEN):], self._after_open
        return events

    def _after_open(self) -> list[Event] | None:
        stripped = self._buf.lstrip()
        if not stripped:
            return None
        self._state = self._in_text
        if stripped[0] != "{":  # not a call after all: the tag is content
            return self._content(self.OPEN)
        self._open_call(stripped)
        self._state = self._in_call
        return []

    def _in_call(self) -> list[Event]:
        events, valid = self._read_call()
        if valid is not None:
            self._state = self._after_call if valid else self._in_text
        return events

    def _after_call(self) -> list[Event] | None:
        stripped = self._buf.lstrip()
        if stripped.startswith(self.CLOSE):
            self._buf, self._state = stripped[len(self.CLOSE):], self._in_text
            return []
        if not stripped or self.CLOSE.startswith(stripped):
            return None
        self._state = self._in_text  # no closing tag: what follows is content
        return []

    def _rest(self) -> list[Event]:
        if self._state == self._in_text:
            return self._content(self._buf)
        if self._state == self._after_open:
            return self._content(self.OPEN + self._buf)
        return []


class Llama3JsonParser(_Calls):
    def __init__(self, parallel: bool = True) -> None:
        super().__init__(parallel)
        self._state = "start"  # start | call | between (after a call) | content

    def _step(self) -> list[Event] | None:
        if self._state == "content":
            out, self._buf = self._buf, ""
            return [Content(out)]
        if self._state == "call":
            events, valid = self._read_call()
            if valid is not None:
                self._state = "between" if valid else "content"
            return events
        stripped = self._buf.lstrip()
        if self._state == "start" and stripped.startswith(PYTHON_TAG):
            self._buf = stripped[len(PYTHON_TAG):]
            return []
        if not stripped or (self._state == "start" and PYTHON_TAG.startswith(stripped)):
            return None
        if self._state == "between" and stripped[0] == ";":
            self._buf = stripped[1:]
            return []
        if stripped[0] == "{":
            self._open_call(stripped)
            self._state = "call"
            return []
        self._state = "content"  # no call: the whole output (or what follows the calls) is content
        if self.calls:
            self._buf = stripped
        return []

    def _rest(self) -> list[Event]:
        return [Content(self._buf)] if self._state in ("start", "content") and self._buf else []


class NamedParser:
    """The whole output is the arguments of `name` (one call)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self.calls = 0

    def _start(self) -> list[Event]:
        if self.calls:
            return []
        self.calls = 1
        return [CallStart(0, self._name)]

    def feed(self, text: str) -> list[Event]:
        return self._start() + [CallArguments(0, text)] if text else []

    def finish(self) -> list[Event]:
        return self._start()


class RequiredParser(_Calls):
    """A JSON array of call objects; anything else in the output is dropped (the grammar allows none)."""

    _opening = None

    def __init__(self, parallel: bool = True) -> None:
        super().__init__(parallel)
        self._opened = False

    def _step(self) -> list[Event] | None:
        if self._call is not None:
            return self._read_call()[0]
        stripped = self._buf.lstrip()
        if not stripped:
            return None
        if stripped[0] == "{" and self._opened:
            self._open_call(stripped)
            return []
        self._opened = self._opened or stripped[0] == "["
        self._buf = stripped[1:]  # "[", ",", "]" or a stray character
        return []


def make_parser(mode: str, function: str | None = None, parallel: bool = True) -> ToolParser:
    """A fresh parser for one choice. mode: "hermes", "llama3_json", "named" (of `function`), "required"."""
    formats = {"hermes": HermesParser, "llama3_json": Llama3JsonParser, "required": RequiredParser}
    if mode == "named":
        return NamedParser(function or "")  # one call whatever `parallel` says
    if mode not in formats:
        raise ValueError(f"unknown tool-call format {mode!r}")
    return formats[mode](parallel)
