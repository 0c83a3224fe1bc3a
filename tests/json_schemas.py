"""Random JSON schemas of bounded outputs, and a validator for them (structured output tests).

`random_schema` draws, from a seeded `random.Random`, the shapes OpenAI's strict mode uses: objects
with every property required and no others, enums, arrays with minItems/maxItems, nested objects,
strings with maxLength, integers and numbers with bounds, booleans. Every string, array and number
is bounded (a number by `multipleOf`: without it, JSON lets its digits go on forever), so an output
that never ends could only come from whitespace.
`check` validates an instance against such a schema (no dependency: the subset is small).
"""

from __future__ import annotations

import random
from typing import Any

NAMES = ["id", "name", "age", "tags", "score", "active", "city", "items", "kind", "size", "note", "level"]
WORDS = ["red", "green", "blue", "alpha", "beta", "yes", "no", "small", "large", "x"]
Schema = dict[str, Any]


def strict_object(properties: dict[str, Schema]) -> Schema:
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


def random_schema(rng: random.Random, depth: int = 0) -> Schema:
    """A top-level object whose properties nest objects and arrays up to two levels down."""
    names = rng.sample(NAMES, rng.randint(1, 4))
    return strict_object({name: _value(rng, depth + 1) for name in names})


def _value(rng: random.Random, depth: int) -> Schema:
    kinds = ["string", "integer", "number", "boolean", "enum"] + (["object", "array"] if depth < 3 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 8)}
    if kind in ("integer", "number"):
        low = rng.randint(-100, 100)
        bounds = {"type": kind, "minimum": low, "maximum": low + rng.randint(1, 500)}
        return bounds if kind == "integer" else {**bounds, "multipleOf": rng.choice([0.5, 0.25, 0.1, 0.01])}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(WORDS, rng.randint(1, 4))}
    if kind == "object":
        return random_schema(rng, depth)
    least = rng.randint(0, 2)
    return {"type": "array", "items": _value(rng, depth + 1), "minItems": least, "maxItems": least + rng.randint(0, 2)}


def check(value: Any, schema: Schema, path: str = "$") -> None:
    """AssertionError naming the path where `value` breaks `schema`."""
    if "enum" in schema:
        assert value in schema["enum"], f"{path}: {value!r} not in {schema['enum']}"
        return
    kind = schema["type"]
    if kind == "object":
        assert isinstance(value, dict) and set(value) == set(schema["properties"]), f"{path}: {value!r}"
        for name, sub in schema["properties"].items():
            check(value[name], sub, f"{path}.{name}")
    elif kind == "array":
        assert isinstance(value, list), f"{path}: {value!r} is not an array"
        assert schema["minItems"] <= len(value) <= schema["maxItems"], f"{path}: {len(value)} items"
        for i, item in enumerate(value):
            check(item, schema["items"], f"{path}[{i}]")
    elif kind == "string":
        assert isinstance(value, str) and len(value) <= schema["maxLength"], f"{path}: {value!r}"
    elif kind == "boolean":
        assert isinstance(value, bool), f"{path}: {value!r} is not a boolean"
    else:
        types = int if kind == "integer" else (int, float)
        assert isinstance(value, types) and not isinstance(value, bool), f"{path}: {value!r} is not an {kind}"
        assert schema["minimum"] <= value <= schema["maximum"], f"{path}: {value!r} out of bounds"
        step = schema.get("multipleOf", 1)
        assert abs(round(value / step) * step - value) < 1e-9, f"{path}: {value!r} is not a multiple of {step}"
