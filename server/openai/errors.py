"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, for the servers and
the router alike; the type follows from the HTTP status. What each status means: docs/API.md.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.requests import Request

from server.openai.wire import JSONBody

_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 502: "bad_gateway",
          503: "service_unavailable"}  # any other: invalid_request_error below 500, else server_error


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, *, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONBody:
    return JSONBody(error_body(status, message, param=param, code=code), status, headers=headers)


async def http_error(request: Request, exc: Exception) -> JSONBody:
    """Unknown path, wrong method: the OpenAI error shape, like every other error (servers and router)."""
    assert isinstance(exc, HTTPException)
    where = f"{request.method} {request.url.path}"
    message = f"route not found: {where}" if exc.status_code == 404 else f"{exc.detail}: {where}"
    return error_response(exc.status_code, message, headers=exc.headers)


class APIError(Exception):
    """An error to answer with `status` in OpenAI's shape."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return error_body(self.status, self.message, param=self.param, code=self.code)


def bad_field(param: str, problem: str) -> APIError:
    """A 400 naming the field: `'<param>': <problem>`."""
    return APIError(400, f"'{param}': {problem}", param=param)
