"""Reading config YAML: strict loading and typed readers whose errors name the file and key path.

`Where` is a position in one file (`configs/x.yaml: context_servers.urls[0]`); its readers check a
value's type and range and raise ConfigError there. The schema itself lives in server/config.py.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A configuration problem; the message names the file and the key path."""


class Where:
    """A position in one config file (`file: a.b.c`) with the typed readers that report there."""

    def __init__(self, source: str, path: tuple[str, ...] = ()) -> None:
        self.source, self.path = source, path

    def key(self, name: str) -> Where:
        return Where(self.source, (*self.path, name))

    def error(self, message: str) -> ConfigError:
        where = ".".join(self.path)
        return ConfigError(f"{self.source}: {where}: {message}" if where else f"{self.source}: {message}")

    def check_keys(self, data: dict[str, Any], allowed: tuple[str, ...]) -> None:
        for name in data:
            if name not in allowed:
                close = difflib.get_close_matches(str(name), allowed, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise self.key(str(name)).error(f"unknown key{hint}; valid keys: {', '.join(allowed)}")

    def mapping(self, data: dict[str, Any], name: str) -> dict[str, Any]:
        value = data.get(name)
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise self.key(name).error(f"must be a mapping, got {_kind(value)}")
        return value

    def string(self, data: dict[str, Any], name: str, default: str) -> str:
        value = data.get(name, default)
        if not isinstance(value, str) or not value:
            raise self.key(name).error(f"must be a non-empty string, got {value!r}")
        return value

    def optional_string(self, data: dict[str, Any], name: str) -> str | None:
        return None if data.get(name) is None else self.string(data, name, "")

    def integer(self, data: dict[str, Any], name: str, default: int, minimum: int) -> int:
        value = data.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.key(name).error(f"must be an integer, got {_kind(value)} {value!r}")
        if value < minimum:
            raise self.key(name).error(f"must be >= {minimum}, got {value}")
        return value

    def number(self, data: dict[str, Any], name: str, default: float, minimum: float) -> float:
        """An int or float >= `minimum` (seconds, say)."""
        value = data.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
            raise self.key(name).error(f"must be a number, got {_kind(value)} {value!r}")
        if value < minimum:
            raise self.key(name).error(f"must be >= {minimum:g}, got {value}")
        return float(value)

    def optional_integer(self, data: dict[str, Any], name: str, minimum: int) -> int | None:
        return None if data.get(name) is None else self.integer(data, name, minimum, minimum)

    def boolean(self, data: dict[str, Any], name: str, default: bool) -> bool:
        value = data.get(name, default)
        if not isinstance(value, bool):
            raise self.key(name).error(f"must be true or false, got {_kind(value)} {value!r}")
        return value

    def port(self, data: dict[str, Any], name: str, default: int) -> int:
        value = self.integer(data, name, default, minimum=1)
        if value > 65535:
            raise self.key(name).error(f"must be a port in 1..65535, got {value}")
        return value

    def choice(self, data: dict[str, Any], name: str, choices: tuple[str, ...], default: str) -> str:
        value = data.get(name, default)
        if value not in choices:
            raise self.key(name).error(f"must be one of {', '.join(choices)}, got {value!r}")
        return value

    def url_list(self, data: dict[str, Any], name: str) -> list[tuple[str, int]]:
        """`urls: ["host:port", ...]` -> [(host, port)]; IPv6 hosts in brackets."""
        urls = data.get(name)
        if not isinstance(urls, list) or not urls:
            raise self.key(name).error(f"must be a non-empty list of host:port strings, got {urls!r}")
        out = []
        for i, url in enumerate(urls):
            where = self.key(f"{name}[{i}]")
            host, sep, port = url.rpartition(":") if isinstance(url, str) else ("", "", "")
            if not sep or not host or not port.isdigit() or "/" in url:
                raise where.error(f"must be host:port (like 127.0.0.1:8001), got {url!r}")
            out.append((host.strip("[]"), where.port({"port": int(port)}, "port", 0)))
        return out


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
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean",
            type(None): "null"}.get(type(value), type(value).__name__)
