"""Is a JSON schema well formed? The keywords' own types, checked without compiling anything, before
the grammar engine compiles it (server/api/structured.py `_checked`)."""

from __future__ import annotations

import re
from typing import Any

TYPES = frozenset({"string", "number", "integer", "boolean", "object", "array", "null"})
ONE_SCHEMA = ("items", "not", "additionalProperties", "additionalItems", "contains", "if", "then", "else",
              "propertyNames", "unevaluatedProperties", "unevaluatedItems")
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
NUMBERS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")


def schema_problem(schema: Any, where: str = "the schema") -> str | None:
    """None when `schema` is well formed; else a sentence naming the first problem and where it is."""
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
