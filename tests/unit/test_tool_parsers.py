"""Tool-call parsers on hand-written model outputs: the calls and content they find, and the same
result however the output is split into streamed pieces (every split point, and random splits)."""

from __future__ import annotations

import random

import pytest

from server.openai.tool_parsers import CallArguments, CallStart, Content, make_parser

WEATHER = '{"city": "Paris", "days": [1, {"unit": "}"}], "note": "a \\"quoted\\" }"}'


def run(mode: str, text: str, cuts: list[int], **kw) -> tuple[str, list[tuple[str, str]]]:
    """(content, [(name, arguments)]) from `text` fed in pieces cut at `cuts`."""
    parser = make_parser(mode, **kw)
    events, start = [], 0
    for end in [*cuts, len(text)]:
        events += parser.feed(text[start:end])
        start = end
    events += parser.finish()
    calls: dict[int, list[str]] = {}
    for event in events:
        if isinstance(event, CallStart):
            assert event.index not in calls and event.index == len(calls)  # announced once, in order
            calls[event.index] = [event.name, ""]
        elif isinstance(event, CallArguments):
            assert event.index in calls  # never before its start
            calls[event.index][1] += event.text
    content = "".join(e.text for e in events if isinstance(e, Content))
    return content, [tuple(calls[i]) for i in sorted(calls)]


# (mode, model output, content, calls)
CASES = [
    ("hermes", f'Let me look.\n<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>\n'
               '<tool_call>{"arguments": {"x": 1}, "name": "second"}</tool_call>',
     "Let me look.", [("get_weather", WEATHER), ("second", '{"x": 1}')]),
    ("hermes", "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>\nDone: 3 < 4.",
     "\nDone: 3 < 4.", [("f", "{}")]),
    ("hermes", "No calls, just a < sign and </tool_call> text.  ", "No calls, just a < sign and </tool_call> text.  ",
     []),
    ("hermes", "<tool_call>not json</tool_call> after", "<tool_call>not json</tool_call> after", []),
    ("hermes", '<tool_call>{"nome": 1}</tool_call>x', '<tool_call>{"nome": 1}</tool_call>x', []),
    ("hermes", '<tool_call>{"name": "cut", "arguments": {"a": [1, 2', "", [("cut", '{"a": [1, 2')]),
    ("hermes", "text then <tool_ca", "text then <tool_ca", []),
    ("llama3_json", '<|python_tag|>{"name": "search", "parameters": {"q": "a;b"}}; {"name": "g", "parameters": {}}',
     "", [("search", '{"q": "a;b"}'), ("g", "{}")]),
    ("llama3_json", ' {"name": "f", "arguments": {"n": 1.5e3}}', "", [("f", '{"n": 1.5e3}')]),
    ("llama3_json", "  Hello, I cannot call tools.", "  Hello, I cannot call tools.", []),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("llama3_json", '{"parameters": {"k": "v"}, "name": "late_name"}', "", [("late_name", '{"k": "v"}')]),
    ("required", '[{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]', "",
     [("f", '{"a": 1}'), ("g", "{}")]),
    ("required", ' [ {"name": "only", "arguments": {"s": "]"}} ] ', "", [("only", '{"s": "]"}')]),
]


@pytest.mark.parametrize(("mode", "text", "content", "calls"), CASES)
def test_parser_finds_calls_and_content(mode, text, content, calls):
    assert run(mode, text, []) == (content, calls)


@pytest.mark.parametrize(("mode", "text", "content", "calls"), CASES)
def test_parser_result_is_the_same_for_every_split(mode, text, content, calls):
    for cut in range(1, len(text)):
        assert run(mode, text, [cut]) == (content, calls), cut
    rng = random.Random(len(text))
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(2, min(20, len(text) - 1))))
        assert run(mode, text, cuts) == (content, calls), cuts
    assert run(mode, text, list(range(1, len(text)))) == (content, calls)  # one character at a time


def test_named_function_output_is_its_arguments():
    assert run("named", '{"city": "Oslo"}', [3, 9], function="get_weather") == (
        "", [("get_weather", '{"city": "Oslo"}')])
    assert run("named", "", [], function="no_args") == ("", [("no_args", "")])


def test_only_the_first_call_without_parallel_tool_calls():
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>'
    assert run("hermes", text, [20, 60], parallel=False) == ("", [("a", "{}")])


def test_a_call_is_announced_as_soon_as_its_head_is_read():
    parser = make_parser("hermes")
    assert parser.feed('Hi <tool_call>{"name": "f", "argu') == [Content("Hi")]
    assert parser.feed('ments": {"x"') == [CallStart(0, "f"), CallArguments(0, '{"x"')]
    assert parser.feed(": 2}}</tool") == [CallArguments(0, ": 2}")]
    assert parser.feed("_call>") == []
    assert parser.finish() == []
    assert parser.calls == 1


def test_unknown_format_is_an_error():
    with pytest.raises(ValueError, match="unknown tool-call format 'xml'"):
        make_parser("xml")
