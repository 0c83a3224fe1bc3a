"""The servers' error handlers (the shape: server/openai/errors.py; statuses: docs/API.md). Wrong
types are a 400 naming the field, not FastAPI's 422, as OpenAI and vLLM answer (so the `openai`
client raises `BadRequestError`). Every handler returns a response and the server keeps serving."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from server.openai.errors import APIError, error_response, http_error
from server.types import RequestOutput

log = logging.getLogger(__name__)


def output_error(output: RequestOutput) -> APIError:
    """The error to answer for a final output that ended in "error" or "abort"."""
    if output.finish_reason == "abort":
        return APIError(503, output.error or "the request was aborted by the server", code="aborted")
    status = output.error_code if 400 <= output.error_code < 600 else 500
    return APIError(status, output.error or "the engine failed the request", code="engine_error")


async def _on_api_error(_: Request, exc: APIError) -> Response:
    return error_response(exc.status, exc.message, param=exc.param, code=exc.code)


async def _on_validation_error(_: Request, exc: RequestValidationError) -> Response:
    errors = exc.errors()
    if not errors:
        return error_response(400, "invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return error_response(400, f"malformed JSON body: {str(first.get('msg')).removeprefix('Invalid JSON: ')}")
    field = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None  # "messages.0.role"
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    where = f"'{field}'" if field else "request body"
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return error_response(400, f"{where}: {msg}{more}", param=field)


async def _on_unexpected(_: Request, exc: Exception) -> Response:
    log.exception("unhandled error in the HTTP layer")
    return error_response(500, f"internal error: {type(exc).__name__}: {exc}")


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, _on_unexpected)
