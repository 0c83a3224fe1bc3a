"""The JSON schemas scripts/bench_grammar.py measures the grammar engines on.

`SCHEMAS`: realistic schemas of the kind clients send, each with an instance that validates (its
tokens are the path the per-token mask timings walk); in "bounded" every string, array and number
has a bound, so an output that never ends can only come from whitespace. `FEATURES`: what OpenAI's strict mode lets a
schema use, each as (schema, a valid instance, an invalid instance): an engine supports a feature
when it compiles the schema, accepts the valid instance to the end and refuses the invalid one.
"""

from __future__ import annotations

from typing import Any

Schema = dict[str, Any]


def _obj(properties: dict[str, Schema]) -> Schema:
    """An object as strict mode wants it: every property required, no others."""
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


SCHEMAS: dict[str, tuple[Schema, Any]] = {
    "person": (
        _obj({"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
              "email": {"type": "string", "format": "email"}, "admin": {"type": "boolean"}}),
        {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com", "admin": False},
    ),
    "order": (
        _obj({"id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
              "status": {"enum": ["pending", "shipped", "delivered", "cancelled"]},
              "items": {"type": "array", "minItems": 1, "maxItems": 10, "items": _obj({
                  "sku": {"type": "string", "maxLength": 12}, "quantity": {"type": "integer", "minimum": 1},
                  "price": {"type": "number", "minimum": 0}})},
              "shipping": _obj({"street": {"type": "string"}, "city": {"type": "string"},
                                "country": {"enum": ["FR", "DE", "US", "JP"]}}),
              "note": {"type": ["string", "null"]}}),
        {"id": "ORD-004217", "status": "shipped",
         "items": [{"sku": "A-100", "quantity": 2, "price": 9.5}, {"sku": "B-7", "quantity": 1, "price": 120}],
         "shipping": {"street": "1 Rue de Rivoli", "city": "Paris", "country": "FR"}, "note": None},
    ),
    "event": (
        _obj({"title": {"type": "string", "minLength": 1, "maxLength": 80},
              "start": {"type": "string", "format": "date-time"}, "end": {"type": "string", "format": "date-time"},
              "attendees": {"type": "array", "maxItems": 5, "items": {"type": "string", "format": "email"}},
              "location": {"anyOf": [_obj({"room": {"type": "string"}}),
                                     _obj({"url": {"type": "string", "format": "uri"}})]}}),
        {"title": "Design review", "start": "2026-03-01T10:00:00Z", "end": "2026-03-01T11:00:00Z",
         "attendees": ["a@x.org", "b@y.org"], "location": {"room": "Turing"}},
    ),
    "tree": (
        {"$defs": {"node": _obj({"value": {"type": "integer"},
                                 "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}})},
         "$ref": "#/$defs/node"},
        {"value": 1, "children": [{"value": 2, "children": []},
                                  {"value": 3, "children": [{"value": 4, "children": []}]}]},
    ),
    "bounded": (
        _obj({"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
              "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["a", "b", "c"]}},
              "admin": {"type": "boolean"}}),
        {"name": "Ada", "age": 36, "tags": ["a", "c"], "admin": True},
    ),
    "wide": (
        _obj({f"field_{i:02d}": ({"type": "integer"} if i % 3 == 0 else {"type": "boolean"} if i % 3 == 1
                                 else {"type": "string", "maxLength": 16}) for i in range(40)}),
        {f"field_{i:02d}": (i if i % 3 == 0 else bool(i % 2) if i % 3 == 1 else f"v{i}") for i in range(40)},
    ),
}

FEATURES: dict[str, tuple[Schema, Any, Any]] = {
    "required + additionalProperties:false": (
        _obj({"a": {"type": "integer"}, "b": {"type": "string"}}), {"a": 1, "b": "x"}, {"a": 1}),
    "nested objects": (
        _obj({"outer": _obj({"inner": _obj({"x": {"type": "boolean"}})})}),
        {"outer": {"inner": {"x": True}}}, {"outer": {"inner": {}}}),
    "enum": (_obj({"c": {"enum": ["red", "green"]}}), {"c": "green"}, {"c": "blue"}),
    "const": (_obj({"v": {"const": "fixed"}}), {"v": "fixed"}, {"v": "other"}),
    "anyOf": (
        _obj({"u": {"anyOf": [{"type": "integer"}, _obj({"s": {"type": "string"}})]}}), {"u": {"s": "a"}}, {"u": "a"}),
    "nullable (type list)": (_obj({"n": {"type": ["integer", "null"]}}), {"n": None}, {"n": "x"}),
    "$defs + $ref": (
        {"$defs": {"p": _obj({"x": {"type": "integer"}})}, **_obj({"a": {"$ref": "#/$defs/p"}})},
        {"a": {"x": 3}}, {"a": {"y": 3}}),
    "recursive $ref": (
        {"$defs": {"l": _obj({"next": {"anyOf": [{"$ref": "#/$defs/l"}, {"type": "null"}]}})}, "$ref": "#/$defs/l"},
        {"next": {"next": None}}, {"next": {"next": 1}}),
    "array minItems/maxItems": (
        _obj({"xs": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3}}),
        {"xs": [1, 2]}, {"xs": [1, 2, 3, 4]}),
    "string minLength/maxLength": (
        _obj({"s": {"type": "string", "minLength": 2, "maxLength": 4}}), {"s": "abc"}, {"s": "abcde"}),
    "string pattern": (_obj({"s": {"type": "string", "pattern": "^[a-z]+-[0-9]{2}$"}}), {"s": "ab-12"}, {"s": "ab-1x"}),
    "format date-time": (_obj({"t": {"type": "string", "format": "date-time"}}),
                         {"t": "2026-01-02T03:04:05Z"}, {"t": "yesterday"}),
    "format date": (_obj({"t": {"type": "string", "format": "date"}}), {"t": "2026-01-02"}, {"t": "2026-1-2x"}),
    "format time": (_obj({"t": {"type": "string", "format": "time"}}), {"t": "03:04:05Z"}, {"t": "3pm"}),
    "format duration": (_obj({"t": {"type": "string", "format": "duration"}}), {"t": "P3DT4H"}, {"t": "3 days"}),
    "format email": (_obj({"e": {"type": "string", "format": "email"}}), {"e": "a@b.co"}, {"e": "not an email"}),
    "format hostname": (_obj({"h": {"type": "string", "format": "hostname"}}), {"h": "example.com"}, {"h": "a b"}),
    "format ipv4": (_obj({"ip": {"type": "string", "format": "ipv4"}}), {"ip": "10.0.0.1"}, {"ip": "10.0.0"}),
    "format ipv6": (_obj({"ip": {"type": "string", "format": "ipv6"}}), {"ip": "::1"}, {"ip": "1:::2:::3"}),
    "format uuid": (_obj({"id": {"type": "string", "format": "uuid"}}),
                    {"id": "123e4567-e89b-12d3-a456-426614174000"}, {"id": "1234"}),
    "number minimum/maximum": (_obj({"x": {"type": "number", "minimum": 0, "maximum": 10}}), {"x": 2.5}, {"x": 11}),
    "exclusiveMinimum/exclusiveMaximum": (
        _obj({"x": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 5}}), {"x": 4}, {"x": 5}),
    "integer multipleOf": (_obj({"x": {"type": "integer", "multipleOf": 5}}), {"x": 15}, {"x": 7}),
}
