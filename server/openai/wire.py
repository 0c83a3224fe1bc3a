"""JSON on the request path: one codec (pydantic-core's, the one the servers' models use) for every
body the router and the servers read and write."""

from __future__ import annotations

from typing import Any

from pydantic_core import from_json, to_json
from starlette.responses import Response

loads = from_json  # ValueError if it is not JSON
dumps = to_json  # dicts, lists, pydantic models and dataclasses -> bytes


class JSONBody(Response):
    """A JSON response written with the same codec (Starlette's JSONResponse uses the `json` module)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return content if isinstance(content, bytes) else to_json(content)
