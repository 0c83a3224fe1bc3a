"""JSON on the request path: one codec (pydantic-core's, the one the servers' models use) for every
body the router and the servers read and write."""

from __future__ import annotations

from typing import Any

from pydantic_core import from_json, to_json
from starlette.responses import Response

__all__ = ["JSONBody", "dumps", "loads"]


def loads(data: bytes | str) -> Any:
    """The JSON value of `data`; ValueError if it is not JSON."""
    return from_json(data)


def dumps(value: Any) -> bytes:
    """JSON bytes of `value` (dicts, lists, pydantic models and dataclasses)."""
    return to_json(value)


class JSONBody(Response):
    """A JSON response written with the same codec (Starlette's JSONResponse uses the `json` module)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return content if isinstance(content, bytes) else to_json(content)
