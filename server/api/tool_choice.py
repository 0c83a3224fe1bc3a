"""Chat `tools` and `tool_choice`: what the chat template gets, what constrains the output, and how
the output becomes `tool_calls` (server/openai/tool_parsers.py).

- no tools, or `tool_choice: "none"`: the template gets no tools and no parser runs.
- `"auto"` (the default with tools): the template renders the tools, and the model's own format
  (read from the template: `tool_format`) is parsed out of its answer. A template without one of the
  formats pdserve parses is refused (400 naming `tools`).
- a named function (`{"type": "function", "function": {"name": F}}`): structured output constrains
  the answer to F's `parameters` (a JSON schema; none: an object), and the whole answer is F's
  arguments: one call.
- `"required"`: structured output constrains the answer to a JSON array of at least one call,
  each `{"name": N, "arguments": A}` where N is one of the tools' names and A follows that tool's
  parameters (`anyOf` over the tools; `maxItems: 1` with `parallel_tool_calls: false`).
With tool calls the template gets the tools too, so the model knows what they are.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from server.api.errors import APIError
from server.openai.formatting import ToolMode
from server.openai.protocol import ChatCompletionRequest
from server.openai.tool_parsers import PYTHON_TAG
from server.types import StructuredSpec

NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    template_tools: list[dict] | None = None  # what the chat template renders
    mode: ToolMode | None = None  # how the answer becomes tool calls
    constraint: StructuredSpec | None = None  # forces the calls (named function, "required")
    param: str = "tools"  # the field a constraint the grammar engine rejects came from


def tool_format(chat_template: str | dict | None) -> str | None:
    """The tool-call format a chat template asks its model for: "hermes" (`<tool_call>`),
    "llama3_json" (Llama 3.1+: `<|python_tag|>`), or None (no tools, or a format pdserve cannot parse)."""
    text = " ".join(chat_template.values()) if isinstance(chat_template, dict) else chat_template or ""
    if "<tool_call>" in text:
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
            raise APIError(400, "'tool_choice': a tool is required or named, but the request has no tools",
                           param="tool_choice")
        return ToolPlan()
    names = [t.function.name for t in body.tools]
    duplicate = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if duplicate is not None:
        raise APIError(400, f"'tools': two tools are named {duplicate!r}", param="tools")
    if choice == "none":
        return ToolPlan()
    rendered = [t.model_dump(exclude_none=True) for t in body.tools]
    parallel = body.parallel_tool_calls is not False
    if choice == "auto":
        return ToolPlan(rendered, _auto_mode(chat_template, parallel))
    if choice == "required":
        schema = required_schema(body.tools, parallel)
        return ToolPlan(rendered, ToolMode("required", parallel=parallel), _schema_spec(schema))
    name = choice.function.name
    if name not in names:
        raise APIError(400, f"'tool_choice.function.name': no tool is named {name!r} (tools: {', '.join(names)})",
                       param="tool_choice.function.name")
    at = names.index(name)
    return ToolPlan(rendered, ToolMode("named", function=name), _schema_spec(_parameters(body.tools[at])),
                    f"tools.{at}.function.parameters")


def _auto_mode(chat_template: str | dict | None, parallel: bool) -> ToolMode:
    fmt = tool_format(chat_template)
    if fmt is None:
        raise APIError(400, "'tools': this model's chat template asks for no tool-call format pdserve parses "
                       "(Hermes <tool_call> or Llama 3 JSON); use tool_choice \"required\" or a named function",
                       param="tools")
    return ToolMode(fmt, parallel=parallel)


def _schema_spec(schema: dict[str, Any]) -> StructuredSpec:
    return StructuredSpec("json_schema", json.dumps(schema, ensure_ascii=False))
