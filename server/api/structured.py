"""Structured output: a request's constraint as the engine's `StructuredSpec`, checked before it
reaches the engine (400 naming the field when the grammar engine rejects it).

Where a constraint comes from (at most one per request):
- `response_format`: `{"type": "json_object"}`, `{"type": "json_schema", "json_schema": {"schema"}}`
  (`{"type": "text"}` constrains nothing);
- vLLM's `structured_outputs`: `json` (a schema), `regex`, `choice`, `grammar`, `json_object`;
- vLLM's older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`;
- chat `tool_choice` "required" or a named function (server/api/tool_choice.py builds its schema).
A JSON schema travels as JSON text, a choice as a JSON list of strings.
"""

from __future__ import annotations

import json
from typing import Any

from server.api.errors import APIError
from server.api.json_schema import schema_problem
from server.engine.structured import check_spec
from server.openai.protocol import SamplingRequest
from server.types import StructuredSpec

ANY_OBJECT: dict[str, Any] = {"type": "object"}


def json_schema_spec(schema: dict[str, Any] | str, param: str) -> StructuredSpec:
    """A schema given as an object or as JSON text; the text must be a JSON object or boolean."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise APIError(400, f"'{param}': not JSON text ({exc})", param=param) from None
    return StructuredSpec("json_schema", json.dumps(schema, ensure_ascii=False))


def _from_response_format(body: SamplingRequest) -> list[tuple[str, StructuredSpec]]:
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return []
    if fmt.type == "json_object":
        return [("response_format", StructuredSpec("json_object"))]
    param = "response_format.json_schema.schema"
    return [(param, json_schema_spec(fmt.json_schema.schema_ or ANY_OBJECT, param))]


def _from_vllm(body: SamplingRequest) -> list[tuple[str, StructuredSpec]]:
    found = []
    if body.structured_outputs is not None:
        (key, value), = [(k, v) for k, v in body.structured_outputs.constraints().items() if v not in (None, False)]
        found.append(_vllm_spec(f"structured_outputs.{key}", key, value))
    for key in ("json", "regex", "choice", "grammar"):
        value = getattr(body, f"guided_{key}")
        if value is not None:
            found.append(_vllm_spec(f"guided_{key}", key, value))
    return found


def _vllm_spec(param: str, key: str, value: Any) -> tuple[str, StructuredSpec]:
    if key == "json":
        return param, json_schema_spec(value, param)
    if key == "choice":
        return param, StructuredSpec("choice", json.dumps(value, ensure_ascii=False))
    if key == "json_object":
        return param, StructuredSpec("json_object")
    return param, StructuredSpec(key, value)


def request_constraint(body: SamplingRequest) -> tuple[str, StructuredSpec] | None:
    """(the field it came from, the constraint) of the request's own fields, or None."""
    found = _from_response_format(body) + _from_vllm(body)
    if len(found) > 1:
        first, second = (p.split(".")[0] for p, _ in found[:2])
        raise APIError(400, f"'{second}': only one structured-output constraint per request ({first} is set too)",
                       param=second)
    return found[0] if found else None


def may_constrain(body: SamplingRequest) -> bool:
    """The request names a constraint (its own fields, or chat tools that may force calls): building
    it compiles a grammar, which the caller runs off the event loop (a new schema takes milliseconds;
    the first one of a large vocabulary, seconds)."""
    tools = getattr(body, "tools", None) and getattr(body, "tool_choice", None) not in ("none", "auto")
    return bool(tools or (body.response_format is not None and body.response_format.type != "text")
                or body.structured_outputs is not None
                or any(getattr(body, f"guided_{k}") is not None for k in ("json", "regex", "choice", "grammar")))


def checked(spec: StructuredSpec, tokenizer: object, param: str) -> StructuredSpec:
    """`spec` if a JSON schema is well formed and the grammar engine compiles it; else a 400 naming `param`."""
    try:
        if spec.kind == "json_schema":
            problem = schema_problem(json.loads(spec.spec))
            if problem is not None:
                raise ValueError(problem)
        check_spec(spec, tokenizer)
    except ValueError as exc:
        raise APIError(400, f"'{param}': {exc}", param=param) from None
    return spec
