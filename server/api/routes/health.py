"""GET /health: 200 once the engine is ready, 503 before; 503 too while draining or when a part the
server needs is broken (`server.api.readiness`: the body's `status` and `detail` say which).

The body carries the process's `epoch`, a uuid made when the process started: a router that sees it
change knows the server behind the URL restarted (its dashboard counts restarts so).
"""

from __future__ import annotations

import uuid
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from server.api.deps import get_ready_engine
from server.types import EngineClient

router = APIRouter()

EPOCH = uuid.uuid4().hex  # once per process start


@router.get("/health")
async def health(request: Request, engine: Annotated[EngineClient, Depends(get_ready_engine)]) -> JSONResponse:
    report = getattr(request.app.state, "health_report", None)
    body = {"status": "ok", "model": engine.model_name, "epoch": EPOCH, **(report() if report is not None else {})}
    return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503)
