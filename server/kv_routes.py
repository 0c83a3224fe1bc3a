"""Extra endpoints of an engine server beyond the OpenAI API."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse


def install_kv_routes(app: FastAPI) -> None:
    @app.get("/kv_cache/hashes")
    async def kv_cache_hashes(request: Request) -> JSONResponse:
        """Hashes of the blocks in this server's reuse cache (kv_cache_aware routing reads them)."""
        return JSONResponse(request.app.state.telemetry.hashes)
