"""Structured output: a request's constraint as the engine's `StructuredSpec`, checked before it
reaches the engine (a 400 naming the field when the grammar engine rejects it)."""

from __future__ import annotations

import json
import re
from typing import Any

from server.engine.structured.compiler import check_spec
from server.openai.errors import bad_field
from server.openai.protocol import GUIDED, SamplingRequest
from server.types import StructuredSpec

ANY_OBJECT: dict[str, Any] = {"type": "object"}
TYPES = frozenset({"string", "number", "integer", "boolean", "object", "array", "null"})
ONE_SCHEMA = ("items", "not", "additionalProperties", "additionalItems", "contains", "if", "then", "else",
              "propertyNames", "unevaluatedProperties", "unevaluatedItems")
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
NUMBERS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")


def json_schema_spec(schema: dict[str, Any] | str, param: str) -> StructuredSpec:
    """A schema given as an object or as JSON text; the text must be a JSON object or boolean."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise bad_field(param, f"not JSON text ({exc})") from None
    return StructuredSpec("json_schema", json.dumps(schema, ensure_ascii=False))


def _constraints(body: SamplingRequest) -> list[tuple[str, StructuredSpec]]:
    """(field, spec) of each constraint the request sets: OpenAI's `response_format`, then vLLM's fields."""
    named = []  # (field, vLLM's name of the constraint, its value)
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        named.append(("response_format", "json_object", True))
    elif fmt is not None and fmt.type == "json_schema":
        named.append(("response_format.json_schema.schema", "json", fmt.json_schema.schema_ or ANY_OBJECT))
    chosen = body.structured_outputs.chosen() if body.structured_outputs is not None else []
    named += [(f"structured_outputs.{key}", key, value) for key, value in chosen]
    named += [(f"guided_{key}", key, getattr(body, f"guided_{key}")) for key in GUIDED
              if getattr(body, f"guided_{key}") is not None]
    return [(param, _spec(param, key, value)) for param, key, value in named]


def _spec(param: str, key: str, value: Any) -> StructuredSpec:
    if key == "json":
        return json_schema_spec(value, param)
    if key == "choice":
        return StructuredSpec("choice", json.dumps(value, ensure_ascii=False))
    return StructuredSpec("json_object") if key == "json_object" else StructuredSpec(key, value)


def request_constraint(body: SamplingRequest, tool_schema: dict[str, Any] | str | None, tool_param: str,
                       tokenizer: object) -> StructuredSpec | None:
    """The request's one constraint, compiled (its fields' or `tool_choice`'s, never both); None if none."""
    found = _constraints(body)
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


def schema_problem(schema: Any, where: str = "the schema") -> str | None:
    """None when `schema` is well formed (the keywords' own types, checked before the grammar engine
    compiles it); else a sentence naming the first problem and where it is."""
    if isinstance(schema, bool):
        return None
    if not isinstance(schema, dict):
        return f"{where} must be a JSON object or a boolean"
    return _keyword_problem(schema, where) or _subschema_problem(schema, where)


def _keyword_problem(schema: dict, where: str) -> str | None:
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [] if kind is None else [kind]
    bad = [k for k in kinds if not isinstance(k, str) or k not in TYPES]
    if bad or (isinstance(kind, list) and not kind):
        return f"{where}: type {bad[0] if bad else kind!r} is not a JSON-schema type ({', '.join(sorted(TYPES))})"
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        return f"{where}: required must be a list of property names"
    if "enum" in schema and not (isinstance(schema["enum"], list) and schema["enum"]):
        return f"{where}: enum must be a non-empty list"
    for key in COUNTS:
        value = schema.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            return f"{where}: {key} must be a non-negative integer"
    for key in NUMBERS:
        if key in schema and (isinstance(schema[key], bool) or not isinstance(schema[key], int | float)):
            return f"{where}: {key} must be a number"
    if "pattern" in schema:
        try:
            re.compile(schema["pattern"])
        except (re.error, TypeError) as exc:
            return f"{where}: pattern is not a regular expression ({exc})"
    return None


def _subschema_problem(schema: dict, where: str) -> str | None:
    for key in ONE_SCHEMA:
        subs = schema.get(key)
        subs = subs if key == "items" and isinstance(subs, list) else [] if key not in schema else [subs]
        for sub in subs:  # draft-07 `items` may be a list of schemas
            if problem := schema_problem(sub, f"{where}.{key}"):
                return problem
    for key in SCHEMA_LISTS:
        if key not in schema:
            continue
        if not isinstance(schema[key], list) or not schema[key]:
            return f"{where}: {key} must be a non-empty list of schemas"
        for i, sub in enumerate(schema[key]):
            if problem := schema_problem(sub, f"{where}.{key}[{i}]"):
                return problem
    for key in SCHEMA_MAPS:
        if key not in schema:
            continue
        if not isinstance(schema[key], dict):
            return f"{where}: {key} must be an object of schemas"
        for name, sub in schema[key].items():
            if problem := schema_problem(sub, f"{where}.{key}.{name}"):
                return problem
    return None
