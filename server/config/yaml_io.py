"""Reading config YAML: strict loading, and msgspec conversion whose errors are ConfigErrors
`<file>: <key.path>: <what is wrong>` (an unknown key gets a close match and the valid keys)."""

from __future__ import annotations

import difflib
import re
import typing
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import msgspec.inspect as mi
import yaml

T = TypeVar("T")
KeyPath = list[str]  # key names and "[i]" list positions

_AT = re.compile(r"(.*) - at `\$(.*)`", re.S)
_PATH_PART = re.compile(r"\.([^.\[]+)|(\[\d+\])")
_OWN_KEY = re.compile(r"([A-Za-z_][\w.]*(?:\[\d+\])?): (.*)", re.S)  # a __post_init__'s "key.path: problem"
_FIELD = re.compile(r"Object (contains unknown|missing required) field `(.+)`")
_ENUM = re.compile(r"Invalid enum value (.+)", re.S)


class ConfigError(ValueError):
    """A configuration problem; the message names the file and the key path."""


def convert(data: Any, schema: type[T], source: str, origin: Callable[[KeyPath], KeyPath] = list) -> T:
    """`data` as a `schema` instance. `origin` maps a key path of `data` to where the file wrote it
    (a deployment's section inherits top-level keys)."""
    try:
        return msgspec.convert(_nulls_dropped(data, mi.type_info(schema)), schema)
    except msgspec.ValidationError as exc:
        raise _error(str(exc), schema, data, source, origin) from None


def _nulls_dropped(data: Any, node: Any) -> Any:
    """`data` without the nulls given for sections (`kv_cache_config:` with nothing under it): a null
    section takes its defaults, as an empty one does."""
    node = node.type if isinstance(node, mi.Metadata) else node
    if not isinstance(node, mi.StructType) or not isinstance(data, dict):
        return data
    fields = {f.encode_name: f.type for f in node.fields}
    section = {k for k, t in fields.items() if isinstance(t.type if isinstance(t, mi.Metadata) else t, mi.StructType)}
    return {k: _nulls_dropped(v, fields.get(k)) for k, v in data.items() if v is not None or k not in section}


def unknown_key(source: str, path: KeyPath, valid: Iterable[str]) -> ConfigError:
    valid = list(valid)
    close = difflib.get_close_matches(path[-1], valid, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigError(f"{source}: {join(path)}: unknown key{hint}; valid keys: {', '.join(valid)}")


def check_keys(data: dict[str, Any], valid: Iterable[str], source: str, at: KeyPath) -> None:
    """For mappings whose keys more than one Struct reads (a deployment's inherited engine keys)."""
    valid = tuple(valid)
    for key in data:
        if key not in valid:
            raise unknown_key(source, [*at, str(key)], valid)


def join(path: KeyPath) -> str:
    return "".join(p if p.startswith("[") else f".{p}" for p in path).lstrip(".")


def _error(text: str, schema: type, data: Any, source: str, origin: Callable[[KeyPath], KeyPath]) -> ConfigError:
    match = _AT.fullmatch(text)
    message, at = (match[1], match[2]) if match else (text, "")
    path = [a or b for a, b in _PATH_PART.findall(at)]
    node = _type_at(mi.type_info(schema), path)
    if field := _FIELD.fullmatch(message):
        path = [*path, field[2]]
        if field[1] == "contains unknown":
            return unknown_key(source, origin(path), _keys(node))
        about = _description(_type_at(mi.type_info(schema), path))
        message = f"required ({about})" if about else "required"
    elif own := _OWN_KEY.fullmatch(message):
        path, message = [*path, *re.findall(r"[^.\[]+|\[\d+\]", own[1])], own[2]
    else:
        message = _expected(message, node, _literal(schema, path), *_value_at(data, path))
    where = join(origin(path))
    return ConfigError(f"{source}: {where}: {message}" if where else f"{source}: {message}")


def _expected(message: str, node: Any, choices: tuple[Any, ...], found: bool, value: Any) -> str:
    """msgspec's "Expected `int` >= 1" as "must be >= 1, got 0"; a described type says what it is."""
    if enum := _ENUM.fullmatch(message):
        about = _description(node) or f"one of {', '.join(map(str, choices))}"  # a described union says all
        return f"must be {about}, got {enum[1]}"
    expected = _EXPECTED.fullmatch(message)
    if expected is None or not found:
        return message[0].lower() + message[1:]
    names, constraint, mismatch = expected.groups()
    got = f", got {_kind(value)} {value!r}" if mismatch else f", got {value!r}"
    if about := _description(node):
        return f"must be {about}{got}"
    if mismatch:
        return f"must be {' or '.join(_NAMES.get(n, n) for n in names.split(' | '))}{got}"
    if constraint == "of length >= 1":
        return f"must be a non-empty {_NOUNS.get(names, names)}{got}"
    constraint = re.sub(r"(?<=\d)\.0\b", "", constraint.removeprefix("that's "))  # ">= 0.0": ">= 0"
    return f"must be {constraint}{got}"


def _literal(schema: type, path: KeyPath) -> tuple[Any, ...]:
    """The choices of the Literal at `path` (and true, false with a bool), in the schema's order."""
    parent = _unwrap(_type_at(mi.type_info(schema), path[:-1])) if path else None
    if not isinstance(parent, mi.StructType):
        return ()
    field = next((f for f in msgspec.structs.fields(parent.cls) if f.encode_name == path[-1]), None)
    choices, todo = [], [field.type] if field else []
    while todo:
        tp = todo.pop(0)
        if typing.get_origin(tp) is typing.Literal:
            choices += typing.get_args(tp)
        elif tp is bool:
            choices += ["true", "false"]
        else:
            todo += typing.get_args(tp)
    return tuple(choices)


_EXPECTED = re.compile(r"Expected `([^`]+)`(?: (.+?))?(, got `[^`]+`)?")
_NAMES = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string",
          "object": "a mapping", "array": "a list", "null": "null"}
_NOUNS = {"str": "string", "array": "list", "object": "mapping"}


def _description(node: Any) -> str | None:
    return node.extra_json_schema.get("description") if isinstance(node, mi.Metadata) else None


def _unwrap(node: Any) -> Any:
    """The non-null member of `X | None`, without its description."""
    if isinstance(node, mi.Metadata):
        node = node.type
    if isinstance(node, mi.UnionType):
        node = next((t for t in node.types if not isinstance(t, mi.NoneType)), node)
    return node.type if isinstance(node, mi.Metadata) else node


def _type_at(node: Any, path: KeyPath) -> Any:
    """The type at `path` (a described type keeps its mi.Metadata wrapper)."""
    for part in path:
        node = _unwrap(node)
        if isinstance(node, mi.StructType):
            node = next((f.type for f in node.fields if f.encode_name == part), None)
        else:
            node = getattr(node, "item_type", None)
    if isinstance(node, mi.UnionType):
        node = next((t for t in node.types if not isinstance(t, mi.NoneType)), node)
    return node


def _keys(node: Any) -> list[str]:
    node = _unwrap(node)
    return [f.encode_name for f in node.fields] if isinstance(node, mi.StructType) else []


def _value_at(data: Any, path: KeyPath) -> tuple[bool, Any]:
    for part in path:
        if isinstance(data, dict) and part in data:
            data = data[part]
        elif isinstance(data, list) and part.startswith("[") and int(part[1:-1]) < len(data):
            data = data[int(part[1:-1])]
        else:
            return False, None
    return True, data


def read_yaml(path: str | Path) -> dict[str, Any]:
    """One YAML mapping; duplicate keys, syntax errors and unreadable files are ConfigErrors."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass: no arbitrary objects
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {_yaml_problem(exc)}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: must be a YAML mapping of keys, got {_kind(data)}")
    return data


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (plain YAML keeps the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        keys = [self.construct_object(k, deep=deep) for k, _ in node.value]
        for i, key in enumerate(keys):
            if key in keys[:i]:
                mark = node.value[i][0].start_mark
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", mark)
        return super().construct_mapping(node, deep=deep)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark else problem


def _kind(value: Any) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)
