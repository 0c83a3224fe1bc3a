"""Extra endpoints of an engine server beyond the OpenAI API (used by the router)."""

from __future__ import annotations

import hmac

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from server.router.orchestrator import RELEASE_TOKEN_HEADER, error_body


def install_kv_routes(app: FastAPI, auth_token: str | None) -> None:
    @app.get("/kv_cache/hashes")
    async def kv_cache_hashes(request: Request) -> JSONResponse:
        """Hashes of the blocks in this server's reuse cache (kv_cache_aware routing reads them)."""
        return JSONResponse(request.app.state.telemetry.read_hashes())

    @app.post("/kv_cache/release")
    async def release_lease(request: Request) -> JSONResponse:
        """Drop a context request's lease now (the router's generation leg never ran)."""
        given = request.headers.get(RELEASE_TOKEN_HEADER, "")
        if auth_token and not hmac.compare_digest(given.encode(), auth_token.encode()):
            return JSONResponse(error_body("missing or wrong " + RELEASE_TOKEN_HEADER, "authentication_error"), 401)
        try:
            body = await request.json()
            ctx_request_id = body["ctx_request_id"]
        except (ValueError, KeyError, TypeError):
            return JSONResponse(error_body("body must be {\"ctx_request_id\": str}", "invalid_request_error"), 400)
        if not isinstance(ctx_request_id, str):
            return JSONResponse(error_body("ctx_request_id must be a string", "invalid_request_error"), 400)
        request.app.state.engine.release_lease(ctx_request_id)
        return JSONResponse({"ctx_request_id": ctx_request_id, "release": "queued"})
