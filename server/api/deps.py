"""FastAPI dependencies: the objects `lifespan` put on `app.state` (tests override these)."""

from __future__ import annotations

from fastapi import Request

from server.api.errors import APIError
from server.metrics import ServerMetrics
from server.types import EngineClient


def get_engine(request: Request) -> EngineClient:
    return request.app.state.engine


def get_ready_engine(request: Request) -> EngineClient:
    """The engine, or a 503 while it is still loading."""
    engine = get_engine(request)
    if not engine.is_ready():
        raise APIError(503, "the engine is not ready yet (model loading)", code="not_ready")
    return engine


def get_metrics(request: Request) -> ServerMetrics:
    return request.app.state.metrics
