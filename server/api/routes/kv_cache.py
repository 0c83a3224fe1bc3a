"""Internal endpoints of an engine server beyond the OpenAI API, for the deployment's own processes.

Each needs the deployment token (`server.auth`): the router releases leases, reads cache snapshots
and subscribes to KV events, generation servers ask a context server where its KV sender listens.
"""

from __future__ import annotations

from fastapi import FastAPI, Request

from server.api.deps import get_ready_engine, require_token
from server.api.routes.health import EPOCH
from server.openai.errors import APIError
from server.openai.wire import JSONBody


def install_kv_routes(app: FastAPI) -> None:
    @app.get("/kv_cache/hashes")
    async def kv_cache_hashes(request: Request) -> JSONBody:
        """A snapshot of this server's reuse cache: block hashes per window and level, and the
        sequence number of the last KV event it includes (server/telemetry/kv_events.py)."""
        require_token(request, "GET /kv_cache/hashes")
        engine = get_ready_engine(request)
        try:
            return JSONBody(await engine.snapshot())
        except (TimeoutError, ConnectionError):  # ConnectionError: its process is gone (server/engine_host/)
            raise APIError(503, "the engine did not answer the cache snapshot in time (still loading?)") from None

    @app.get("/kv_cache/events")
    async def kv_events(request: Request) -> JSONBody:
        """Where this server publishes its KV events, and its epoch."""
        require_token(request, "GET /kv_cache/events")
        info = getattr(request.app.state.engine, "info", None)  # the engine's `Ready` says where, once loaded
        if info is None or info.kv_events_endpoint is None:
            get_ready_engine(request)
            raise APIError(404, "this server publishes no KV events (it has no deployment token)")
        return JSONBody({"endpoint": info.kv_events_endpoint, "epoch": EPOCH})

    @app.get("/kv_cache/endpoint")
    async def kv_endpoint(request: Request) -> JSONBody:
        """Context side: the address and epoch of this server's KV sender (and of each rank's)."""
        require_token(request, "GET /kv_cache/endpoint")
        engine = request.app.state.engine
        links = engine.links() if engine is not None else None
        if links is None or links.sender is None:
            raise APIError(404, "this server has no KV sender (not a context server, or not ready yet)")
        (endpoint, epoch), ranks = links.sender, links.sender_endpoints
        # a tensor-parallel server lists every rank's KV sender, rank 0's first (its handshakes name them too)
        return JSONBody({"endpoint": endpoint, "epoch": epoch, "endpoints": list(ranks or (endpoint,))})

    @app.post("/kv_cache/release")
    async def release_lease(request: Request) -> JSONBody:
        """Drop a context request's lease now (the router's generation leg never ran)."""
        require_token(request, "POST /kv_cache/release")
        try:
            body = await request.json()
            ctx_request_id = body["ctx_request_id"]
        except (ValueError, KeyError, TypeError):
            raise APIError(400, "body must be {\"ctx_request_id\": str}") from None
        if not isinstance(ctx_request_id, str):
            raise APIError(400, "ctx_request_id must be a string", param="ctx_request_id")
        request.app.state.engine.release_lease(ctx_request_id)
        return JSONBody({"ctx_request_id": ctx_request_id, "release": "queued"})

