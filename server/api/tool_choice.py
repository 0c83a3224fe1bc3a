"""Chat `tools` and `tool_choice` (docs/API.md, "Tool calling"): what the chat template gets, what
constrains the output (a named function's `parameters`; for "required", an array of calls: a JSON
schema, compiled with the request's other constraint fields by server/api/structured.py), and how the
output becomes `tool_calls` (server/openai/tool_parsers.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from server.openai.errors import bad_field
from server.openai.formatting import ToolMode
from server.openai.protocol import ChatCompletionRequest
from server.openai.tool_parsers import PYTHON_TAG, HermesParser

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

