"""A chat request's prompt and tools.

Messages -> prompt token ids, through the model's own chat template (messages shaped as
transformers' templates expect them; tool call arguments as objects).

`tools` and `tool_choice` (docs/API.md, "Tool calling"): what the chat template gets, what
constrains the output (a named function's `parameters`; for "required", an array of calls: a JSON
schema, compiled with the request's other constraint fields by server/api/structured.py), and how the
output becomes `tool_calls` (server/openai/tool_parsers.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError

from server.openai.errors import APIError, bad_field
from server.openai.formatting import ToolMode
from server.openai.protocol import ChatCompletionRequest, ChatMessage
from server.openai.tool_parsers import PYTHON_TAG, HermesParser


def _message_text(content, index: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise APIError(400, f"only text content is supported (messages.{index} has '{part.type}')",
                           param=f"messages.{index}.content")
        texts.append(part.text)
    return "".join(texts)


def _tool_calls(message: ChatMessage, index: int) -> list[dict]:
    if message.role != "assistant":
        raise bad_field(f"messages.{index}.tool_calls", "only assistant messages carry tool calls")
    calls = []
    for j, call in enumerate(message.tool_calls):
        param = f"messages.{index}.tool_calls.{j}.function.arguments"
        try:
            arguments = json.loads(call.function.arguments)
        except ValueError:
            raise bad_field(param, "not JSON text") from None
        calls.append({"id": call.id, "type": "function",
                      "function": {"name": call.function.name, "arguments": arguments}})
    return calls


def template_message(message: ChatMessage, index: int) -> dict:
    out = {"role": message.role, "content": _message_text(message.content, index)}
    if message.tool_calls:
        out["tool_calls"] = _tool_calls(message, index)
    if message.role == "tool":
        if not message.tool_call_id:
            raise bad_field(f"messages.{index}.tool_call_id", "a tool message names the call it answers")
        out["tool_call_id"] = message.tool_call_id
    return out


def chat_prompt_ids(body: ChatCompletionRequest, tokenizer, tools: list[dict] | None = None) -> list[int]:
    """Render the messages (and `tools`) with the tokenizer's chat template (generation prompt added), tokenise."""
    messages = [template_message(m, i) for i, m in enumerate(body.messages)]
    if getattr(tokenizer, "chat_template", None) is None:
        raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions",
                       param="messages")
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    except (TemplateError, ValueError, TypeError) as exc:
        raise APIError(400, f"the chat template refused these messages: {exc}", param="messages") from exc
    # The template already wrote any special tokens (BOS) it wants.
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    if not ids:
        raise APIError(400, "messages render to an empty prompt", param="messages")
    return ids


# ---- tools

NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    template_tools: list[dict] | None = None  # what the chat template renders
    mode: ToolMode | None = None  # how the answer becomes tool calls
    schema: dict[str, Any] | str | None = None  # the JSON schema that forces the calls (named function, "required")
    param: str = "tools"  # the field a schema the grammar engine rejects came from


def tool_format(chat_template: str | dict | None) -> str | None:
    """The tool-call format a chat template asks its model for: "hermes" (`<tool_call>`),
    "llama3_json" (Llama 3.1+: `<|python_tag|>`), or None (no tools, or a format pdserve cannot parse)."""
    text = " ".join(chat_template.values()) if isinstance(chat_template, dict) else chat_template or ""
    if HermesParser.OPEN in text:
        return "hermes"
    if PYTHON_TAG in text:
        return "llama3_json"
    return None


def _parameters(tool) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters is not None else NO_ARGUMENTS


def required_schema(tools, parallel: bool) -> dict[str, Any]:
    calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                               "arguments": _parameters(t)},
              "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def tool_plan(body: ChatCompletionRequest, chat_template: str | dict | None) -> ToolPlan:
    choice = body.tool_choice or ("auto" if body.tools else "none")
    if not body.tools:
        if choice not in ("none", "auto"):
            raise bad_field("tool_choice", "a tool is required or named, but the request has no tools")
        return ToolPlan()
    names = [t.function.name for t in body.tools]
    duplicate = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if duplicate is not None:
        raise bad_field("tools", f"two tools are named {duplicate!r}")
    if choice == "none":
        return ToolPlan()
    rendered = [t.model_dump(exclude_none=True) for t in body.tools]
    parallel = body.parallel_tool_calls is not False
    if choice == "auto":
        fmt = tool_format(chat_template)
        if fmt is None:
            raise bad_field("tools", "this model's chat template asks for no tool-call format pdserve parses (Hermes "
                            "<tool_call> or Llama 3 JSON); use tool_choice \"required\" or a named function")
        return ToolPlan(rendered, ToolMode(fmt, parallel=parallel))
    if choice == "required":
        schema = required_schema(body.tools, parallel)
        return ToolPlan(rendered, ToolMode("required", parallel=parallel), schema)
    name = choice.function.name
    if name not in names:
        raise bad_field("tool_choice.function.name", f"no tool is named {name!r} (tools: {', '.join(names)})")
    at = names.index(name)
    param = f"tools.{at}.function.parameters"
    return ToolPlan(rendered, ToolMode("named", function=name), _parameters(body.tools[at]), param)

