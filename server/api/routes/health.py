"""GET /health: 200 once the engine is ready, 503 before."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends

from server.api.deps import get_ready_engine
from server.types import EngineClient

router = APIRouter()


@router.get("/health")
async def health(engine: Annotated[EngineClient, Depends(get_ready_engine)]) -> dict:
    return {"status": "ok", "model": engine.model_name}
