"""FastAPI dependencies: the objects `lifespan` put on `app.state` (tests override these)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, TypeVar

from fastapi import Depends, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from server.openai.errors import APIError
from server.types import EngineClient

M = TypeVar("M", bound=BaseModel)


def json_body(model: type[M]) -> Callable[[Request], Awaitable[M]]:
    """Parse the body as JSON into `model` whatever the Content-Type (`curl -d` sends a form type)."""

    async def parse(request: Request) -> M:
        raw = await request.body()
        if not raw.strip():
            raise APIError(400, "the request body is empty: send a JSON object")
        try:
            return model.model_validate_json(raw)
        except ValidationError as exc:
            raise RequestValidationError(exc.errors(include_url=False, include_context=False)) from None

    return parse


def get_engine(request: Request) -> EngineClient:
    return request.app.state.engine


def get_ready_engine(request: Request) -> EngineClient:
    """The engine, or a 503 while it is still loading."""
    engine = get_engine(request)
    if engine is None or not engine.is_ready():
        raise APIError(503, "the engine is not ready yet (model loading)", code="not_ready")
    return engine


Engine = Annotated[EngineClient, Depends(get_engine)]
ReadyEngine = Annotated[EngineClient, Depends(get_ready_engine)]
