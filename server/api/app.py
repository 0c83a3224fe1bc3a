"""`create_app`: the FastAPI application of one server; the engine is made in `lifespan` and
reached through `server.api.deps` (no module globals)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager

from fastapi import FastAPI

from server.api.builder import DEFAULT_MAX_N
from server.api.context_directory import ContextDirectory
from server.api.errors import install_error_handlers
from server.api.routes import health, v1
from server.openai.openapi import openapi_document
from server.telemetry.metrics import ServerMetrics
from server.types import EngineClient

# Returns the engine, or an async context manager that yields it and shuts it down on exit.
EngineFactory = Callable[[], EngineClient | AbstractAsyncContextManager[EngineClient]]


def create_app(engine_factory: EngineFactory, *, metrics: ServerMetrics | None = None,
               auth_token: str | None = None, context_directory: ContextDirectory | None = None,
               max_n: int = DEFAULT_MAX_N) -> FastAPI:
    """The HTTP app. `engine_factory()` runs once at startup (in `lifespan`); pass the engine the same
    `metrics` that /metrics exposes. `context_directory` (generation servers) knows the only KV
    endpoints this server may pull from (`server.api.access`)."""

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
    install_error_handlers(app)
    for module in (v1, health):
        app.include_router(module.router)
    return app
