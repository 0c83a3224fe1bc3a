"""GET /health: 200 once the engine is ready, 503 before.

The body carries the process's `epoch`, a uuid made when the process started: a router that sees it
change knows the server behind the URL restarted (its dashboard counts restarts so).
"""

from __future__ import annotations

import uuid
from typing import Annotated

from fastapi import APIRouter, Depends

from server.api.deps import get_ready_engine
from server.types import EngineClient

router = APIRouter()

EPOCH = uuid.uuid4().hex  # once per process start


@router.get("/health")
async def health(engine: Annotated[EngineClient, Depends(get_ready_engine)]) -> dict:
    return {"status": "ok", "model": engine.model_name, "epoch": EPOCH}
