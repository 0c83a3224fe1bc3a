"""GET /metrics: Prometheus text exposition of this server's registry."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends
from starlette.responses import Response

from server.api.deps import get_metrics
from server.telemetry.metrics import CONTENT_TYPE_LATEST, ServerMetrics

router = APIRouter()


@router.get("/metrics")
async def metrics(registry: Annotated[ServerMetrics, Depends(get_metrics)]) -> Response:
    return Response(registry.render(), media_type=CONTENT_TYPE_LATEST)
