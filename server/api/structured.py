"""Structured output: a request's constraint as the engine's `StructuredSpec`, checked before it
reaches the engine (a 400 naming the field when the grammar engine rejects it)."""

from __future__ import annotations

import json
from typing import Any

from server.api.json_schema import schema_problem
from server.engine.structured.compiler import check_spec
from server.openai.errors import bad_field
from server.openai.protocol import SamplingRequest
from server.types import StructuredSpec

ANY_OBJECT: dict[str, Any] = {"type": "object"}
GUIDED = ("json", "regex", "choice", "grammar")  # vLLM's older `guided_*` fields


def json_schema_spec(schema: dict[str, Any] | str, param: str) -> StructuredSpec:
    """A schema given as an object or as JSON text; the text must be a JSON object or boolean."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise bad_field(param, f"not JSON text ({exc})") from None
    return StructuredSpec("json_schema", json.dumps(schema, ensure_ascii=False))


def _from_response_format(body: SamplingRequest) -> list[tuple[str, StructuredSpec]]:
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return []
    if fmt.type == "json_object":
        return [("response_format", StructuredSpec("json_object"))]
    param = "response_format.json_schema.schema"
    return [(param, json_schema_spec(fmt.json_schema.schema_ or ANY_OBJECT, param))]


def _vllm_fields(body: SamplingRequest) -> list[tuple[str, str, Any]]:
    """(field, kind, value) of each of vLLM's constraint fields the request sets."""
    found = []
    if body.structured_outputs is not None:
        (key, value), = body.structured_outputs.chosen()
        found.append((f"structured_outputs.{key}", key, value))
    for key in GUIDED:
        value = getattr(body, f"guided_{key}")
        if value is not None:
            found.append((f"guided_{key}", key, value))
    return found


def _vllm_spec(param: str, key: str, value: Any) -> StructuredSpec:
    if key == "json":
        return json_schema_spec(value, param)
    if key == "choice":
        return StructuredSpec("choice", json.dumps(value, ensure_ascii=False))
    if key == "json_object":
        return StructuredSpec("json_object")
    return StructuredSpec(key, value)


def request_constraint(body: SamplingRequest, tool_schema: dict[str, Any] | str | None, tool_param: str,
                       tokenizer: object) -> StructuredSpec | None:
    """The request's one constraint, compiled (its fields' or `tool_choice`'s, never both); None if none."""
    found = _from_response_format(body) + [(p, _vllm_spec(p, key, value)) for p, key, value in _vllm_fields(body)]
    if len(found) > 1:
        first, second = (p.split(".")[0] for p, _ in found[:2])
        raise bad_field(second, f"only one structured-output constraint per request ({first} is set too)")
    if found and tool_schema is not None:
        field = found[0][0].split(".")[0]
        raise bad_field(field, "tool_choice constrains the answer to tool calls; it cannot be combined with another "
                        "structured-output constraint")
    if tool_schema is not None:
        found = [(tool_param, json_schema_spec(tool_schema, tool_param))]
    return _checked(found[0][1], tokenizer, found[0][0]) if found else None


def _checked(spec: StructuredSpec, tokenizer: object, param: str) -> StructuredSpec:
    """`spec` if a JSON schema is well formed and the grammar engine compiles it; else a 400 naming `param`."""
    try:
        if spec.kind == "json_schema":
            problem = schema_problem(json.loads(spec.spec))
            if problem is not None:
                raise ValueError(problem)
        check_spec(spec, tokenizer)
    except ValueError as exc:
        raise bad_field(param, str(exc)) from None
    return spec
