"""Chat tools through the HTTP layer: what the template renders, what constrains the output, and the
`tool_calls` the answer carries, in JSON and SSE, parsed back with the `openai` package's models."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from fastapi.testclient import TestClient
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from test_api_engine_fake import FakeEngine, sse_chunks

from server.api.app import create_app
from server.api.chat import tool_format
from server.models.tiny_tokenizer import CHAT_TEMPLATE as HERMES_TEMPLATE
from server.types import StructuredSpec

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": PARAMS}},
         {"type": "function", "function": {"name": "get_time"}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
LLAMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>"
                  "{{ m['content'] }}<|eot_id|>{% endfor %}{% if tools %}{{ tools | tojson }} Answer "
                  "<|python_tag|>{\"name\": ..., \"parameters\": ...}{% endif %}")


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine(max_seq_len=2048, chat_template=HERMES_TEMPLATE)


@pytest.fixture
def client(engine):
    with TestClient(create_app(lambda: engine)) as c:
        yield c


def streamed_calls(chunks: list[dict]) -> tuple[str, dict[int, dict]]:
    """Content and tool calls put together from deltas, checking OpenAI's delta shape."""
    content, calls = "", {}
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk)
        delta = chunk["choices"][0]["delta"] if chunk["choices"] else {}
        content += delta.get("content") or ""
        for call in delta.get("tool_calls", []):
            if "id" in call:  # a call's first delta: index, id, type, name
                assert set(call) == {"index", "id", "type", "function"} and call["type"] == "function"
                assert call["index"] not in calls
                calls[call["index"]] = {"id": call["id"], "name": call["function"]["name"],
                                        "arguments": call["function"]["arguments"]}
            else:  # later ones: argument fragments
                assert set(call) == {"index", "function"} and set(call["function"]) == {"arguments"}
                calls[call["index"]]["arguments"] += call["function"]["arguments"]
    return content, calls


def test_auto_renders_the_tools_and_parses_the_calls(client, engine):
    engine.reply = f"Checking.\n{CALL}"
    body = client.post("/v1/chat/completions", json={"messages": ASK, "tools": TOOLS, "max_tokens": 200}).json()
    ChatCompletion.model_validate(body)
    prompt = engine.tokenizer.decode(engine.requests[-1].prompt_token_ids)
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather", "description": "Weather", ' in prompt
    assert engine.requests[-1].sampling.structured is None
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length"  # the fake stops by length: "tool_calls" only after a stop
    message = choice["message"]
    assert message["content"] == "Checking."
    assert [c["function"] for c in message["tool_calls"]] == [{"name": "get_weather",
                                                               "arguments": '{"city": "Paris"}'}]
    assert message["tool_calls"][0]["id"].startswith("call_") and message["tool_calls"][0]["type"] == "function"


def test_streamed_tool_calls_equal_the_whole_answer(client, engine):
    engine.reply = f"{CALL}\n{CALL.replace('Paris', 'Oslo')}"
    request = {"messages": ASK, "tools": TOOLS, "max_tokens": 300}
    whole = client.post("/v1/chat/completions", json=request).json()["choices"][0]["message"]
    chunks = sse_chunks(client.post("/v1/chat/completions", json={**request, "stream": True}))
    content, calls = streamed_calls(chunks)
    assert content == "" and whole["content"] is None
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]] == [
        ("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Oslo"}')]
    assert sum(1 for c in chunks if c["choices"] and len(c["choices"][0]["delta"].get("tool_calls", [])) > 0) > 4


def test_finish_reason_is_tool_calls_when_the_model_stopped(client, engine):
    engine.reply = CALL

    async def stopping(req):  # the model wrote its end-of-sequence token after the call
        async for output in FakeEngine.generate(engine, req):
            yield replace(output, finish_reason="stop") if output.finished else output

    engine.generate = stopping
    request = {"messages": ASK, "tools": TOOLS, "max_tokens": 200}
    assert client.post("/v1/chat/completions", json=request).json()["choices"][0]["finish_reason"] == "tool_calls"
    chunks = sse_chunks(client.post("/v1/chat/completions", json={**request, "stream": True}))
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "tool_calls"


def test_none_passes_no_tools_and_parses_nothing(client, engine):
    engine.reply = CALL
    body = client.post("/v1/chat/completions", json={"messages": ASK, "tools": TOOLS, "tool_choice": "none",
                                                     "max_tokens": 200}).json()
    assert "<tools>" not in engine.tokenizer.decode(engine.requests[-1].prompt_token_ids)
    assert body["choices"][0]["message"] == {"role": "assistant", "content": CALL}


def test_named_function_is_forced_by_its_schema(client, engine):
    engine.reply = '{"city": "Rome"}'
    named = {"type": "function", "function": {"name": "get_weather"}}
    request = {"messages": ASK, "tools": TOOLS, "tool_choice": named}
    body = client.post("/v1/chat/completions", json=request).json()
    ChatCompletion.model_validate(body)
    assert engine.requests[-1].sampling.structured == StructuredSpec("json_schema", json.dumps(PARAMS))
    assert body["choices"][0]["message"]["content"] is None
    assert [c["function"] for c in body["choices"][0]["message"]["tool_calls"]] == [
        {"name": "get_weather", "arguments": '{"city": "Rome"}'}]
    content, calls = streamed_calls(sse_chunks(client.post("/v1/chat/completions", json={**request, "stream": True})))
    assert (content, [(c["name"], c["arguments"]) for c in calls.values()]) == (
        "", [("get_weather", '{"city": "Rome"}')])


def test_required_forces_an_array_of_calls(client, engine):
    engine.reply = '[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Lima"}}]'
    request = {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}
    body = client.post("/v1/chat/completions", json=request).json()
    schema = json.loads(engine.requests[-1].sampling.structured.spec)
    assert schema == {"type": "array", "minItems": 1, "maxItems": 1, "items": {"anyOf": [
        {"type": "object", "properties": {"name": {"type": "string", "enum": ["get_weather"]}, "arguments": PARAMS},
         "required": ["name", "arguments"], "additionalProperties": False},
        {"type": "object", "properties": {"name": {"type": "string", "enum": ["get_time"]},
                                          "arguments": {"type": "object", "properties": {}}},
         "required": ["name", "arguments"], "additionalProperties": False}]}}
    assert [c["function"] for c in body["choices"][0]["message"]["tool_calls"]] == [
        {"name": "get_time", "arguments": "{}"}]  # parallel_tool_calls false: the first only
    body = client.post("/v1/chat/completions", json={**request, "parallel_tool_calls": True}).json()
    assert "maxItems" not in json.loads(engine.requests[-1].sampling.structured.spec)
    assert [c["function"]["name"] for c in body["choices"][0]["message"]["tool_calls"]] == ["get_time", "get_weather"]


def test_earlier_calls_and_tool_results_reach_the_template(client, engine):
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    assert client.post("/v1/chat/completions", json={"messages": history, "tools": TOOLS,
                                                     "max_tokens": 2}).status_code == 200
    prompt = engine.tokenizer.decode(engine.requests[-1].prompt_token_ids)
    assert prompt.endswith('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
                           '"Paris"}}\n</tool_call>\n<|im_end|>\n<|im_start|>tool\n<tool_response>\nsunny\n'
                           '</tool_response><|im_end|>\n<|im_start|>assistant\n')


def test_llama3_template_is_parsed_as_llama_json():
    engine = FakeEngine(max_seq_len=2048, chat_template=LLAMA_TEMPLATE)
    engine.reply = '{"name": "get_weather", "parameters": {"city": "Bonn"}}'
    with TestClient(create_app(lambda: engine)) as client:
        body = client.post("/v1/chat/completions", json={"messages": ASK, "tools": TOOLS, "max_tokens": 100}).json()
    assert [c["function"] for c in body["choices"][0]["message"]["tool_calls"]] == [
        {"name": "get_weather", "arguments": '{"city": "Bonn"}'}]
    assert (tool_format(LLAMA_TEMPLATE), tool_format(HERMES_TEMPLATE), tool_format("{{ messages }}")) == (
        "llama3_json", "hermes", None)


BAD_TOOLS = [
    ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools.0",
     "'tools.0': only function tools are supported by pdserve (this one is 'custom')"),
    ({"tools": [{"type": "function"}]}, "tools.0", "'tools.0': a function tool needs its function"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name", "'tool_choice.function.name': no tool is named 'nope' (tools: get_weather, "
                                  "get_time)"),
    ({"tool_choice": "required"}, "tool_choice", "'tool_choice': a tool is required or named, but the request has no "
                                                 "tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice",
     "'tool_choice': must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": "
     "...}}"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools", "'tools': two tools are named 'get_weather'"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name",
     "'tools.0.function.name': String should match pattern '^[a-zA-Z0-9_-]{1,64}$'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "obj"}}}],
      "tool_choice": "required"}, "tools", "'tools': the schema.items.anyOf[0].properties.arguments: type 'obj' is "
                                           "not a JSON-schema type (array, boolean, integer, null, number, object, "
                                           "string)"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "obj"}}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools.0.function.parameters",
     "'tools.0.function.parameters': the schema: type 'obj' is not a JSON-schema type (array, boolean, integer, "
     "null, number, object, string)"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     "'response_format': tool_choice constrains the answer to tool calls; it cannot be combined with another "
     "structured-output constraint"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}, {"role": "user", "content": "y", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages.1.tool_calls",
     "'messages.1.tool_calls': only assistant messages carry tool calls"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "f", "arguments": "{oops"}}]}]}, "messages.0.tool_calls.0.function.arguments",
     "'messages.0.tool_calls.0.function.arguments': not JSON text"),
    ({"messages": [{"role": "tool", "content": "sunny"}]}, "messages.0.tool_call_id",
     "'messages.0.tool_call_id': a tool message names the call it answers"),
]


@pytest.mark.parametrize(("change", "param", "message"), BAD_TOOLS)
def test_bad_tools_are_400_naming_the_field(client, engine, change, param, message):
    response = client.post("/v1/chat/completions", json={"messages": ASK, **change})
    assert response.status_code == 400, response.text
    assert response.json() == {"error": {"message": message, "type": "invalid_request_error", "param": param,
                                         "code": None}}
    assert engine.requests == []


def test_auto_is_refused_for_a_template_without_a_tool_format():
    engine = FakeEngine()  # its template renders no tools
    with TestClient(create_app(lambda: engine)) as client:
        response = client.post("/v1/chat/completions", json={"messages": ASK, "tools": TOOLS})
        assert response.status_code == 400
        assert response.json()["error"] == {
            "message": "'tools': this model's chat template asks for no tool-call format pdserve parses (Hermes "
                       "<tool_call> or Llama 3 JSON); use tool_choice \"required\" or a named function",
            "type": "invalid_request_error", "param": "tools", "code": None}
        named = {"type": "function", "function": {"name": "get_time"}}
        engine.reply = "{}"
        body = client.post("/v1/chat/completions", json={"messages": ASK, "tools": TOOLS, "tool_choice": named}).json()
        assert body["choices"][0]["message"]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": "{}"}
