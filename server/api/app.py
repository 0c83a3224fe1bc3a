"""`create_app`: the FastAPI application of one server; the engine is made in `lifespan` and
reached through `server.api.deps` (no module globals).

Its error handlers answer in OpenAI's shape (server/openai/errors.py; statuses: docs/API.md). Wrong
types are a 400 naming the field, not FastAPI's 422, as OpenAI and vLLM answer (so the `openai`
client raises `BadRequestError`). Every handler returns a response and the server keeps serving."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from server.api.builder import DEFAULT_MAX_N
from server.api.context_directory import ContextDirectory
from server.api.routes import health, v1
from server.openai.errors import APIError, error_response, http_error
from server.openai.openapi import openapi_document
from server.telemetry.metrics import ServerMetrics
from server.types import EngineClient

log = logging.getLogger(__name__)

# Returns the engine, or an async context manager that yields it and shuts it down on exit.
EngineFactory = Callable[[], EngineClient | AbstractAsyncContextManager[EngineClient]]


def create_app(engine_factory: EngineFactory, *, metrics: ServerMetrics | None = None,
               auth_token: str | None = None, context_directory: ContextDirectory | None = None,
               max_n: int = DEFAULT_MAX_N) -> FastAPI:
    """The HTTP app. `engine_factory()` runs once at startup (in `lifespan`); pass the engine the same
    `metrics` that /metrics exposes. `context_directory` (generation servers) knows the only KV
    endpoints this server may pull from (`server.api.deps`)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with AsyncExitStack() as stack:
            if context_directory is not None:
                context_directory.start()
                stack.push_async_callback(context_directory.stop)
            engine = engine_factory()
            if isinstance(engine, AbstractAsyncContextManager):
                engine = await stack.enter_async_context(engine)
            app.state.engine = engine
            try:
                yield
            finally:
                app.state.engine = None

    app = FastAPI(title="pdserve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.openapi = openapi_document  # request bodies included (FastAPI's own shows none: see json_body)
    app.state.metrics = metrics if metrics is not None else ServerMetrics()
    app.state.auth_token = auth_token
    app.state.context_directory = context_directory
    app.state.max_n = max_n
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, _on_unexpected)
    for module in (v1, health):
        app.include_router(module.router)
    return app


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
