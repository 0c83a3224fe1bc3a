"""GET /health, GET /health_generate (docs/SECURITY.md, "Health") and GET /metrics.

/health stays cheap: the engine checks its KV state periodically and this route reports the verdict,
with the server's drain and KV links (`_report`). /health_generate runs one greedy token under a fresh
`cache_salt`."""

from __future__ import annotations

import asyncio
import secrets
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from server.api.builder import new_request_id
from server.api.deps import ReadyEngine
from server.openai.wire import JSONBody
from server.telemetry.metrics import CONTENT_TYPE_LATEST
from server.types import EngineClient, GenerateRequest, LinkState, SamplingParams
from transceiver.receiver.link import INCOMPATIBLE, PEER_COMPATIBLE

router = APIRouter()

EPOCH = uuid.uuid4().hex  # once per process start
PROBE_TIMEOUT_S = 30.0
PROBE_PROMPT = "pdserve readiness probe"
UNKNOWN_ENDPOINT = "unknown"


@router.get("/health")
async def health(request: Request, engine: ReadyEngine) -> JSONBody:
    body = {"status": "ok", "model": engine.model_name, "epoch": EPOCH, **_report(request.app)}
    problem = getattr(engine, "health_problem", lambda: None)()
    if problem is not None and body["status"] == "ok":
        body.update(status="unhealthy", reason=problem)
    return JSONBody(body, status_code=200 if body["status"] == "ok" else 503)


def _report(app: Any) -> dict:
    """What /health says beyond a loaded engine; any status but "ok" is a 503, in this precedence:
    `draining` (SIGTERM), `unhealthy` (a transceiver socket thread died), `incompatible` (a handshake
    found KV layouts that disagree; `detail` names the field). A generation server also lists each
    context server's handshake state (`context_servers`)."""
    drain = getattr(app.state, "drain", None)
    if drain is not None and drain.draining:
        return drain.report()
    engine = getattr(app.state, "engine", None)
    links: LinkState = engine.links() if engine is not None else LinkState()
    if links.dead:
        return {"status": "unhealthy",
                "detail": f"the transceiver socket thread {', '.join(links.dead)} died: no KV transfer can run"}
    directory = getattr(app.state, "context_directory", None)
    if directory is None or links.peers is None:
        return {}
    peers = {}  # context server URL -> the state of this server's handshake with its KV sender
    for url in directory.context_urls:
        endpoint = directory.endpoint_of(url)
        peers[url] = UNKNOWN_ENDPOINT if endpoint is None else links.peers.get(endpoint, "unchecked")
    if any(state != PEER_COMPATIBLE for state in peers.values()):
        directory.nudge()  # learn endpoints and shake hands now, not at the next interval
    bad = {url: state for url, state in peers.items() if state.startswith(INCOMPATIBLE)}
    if bad:
        detail = "; ".join(f"context server {url}: {state.removeprefix(INCOMPATIBLE + ': ')}"
                           for url, state in bad.items())
        return {"status": INCOMPATIBLE, "detail": detail, "context_servers": peers}
    return {"context_servers": peers}


@router.get("/health_generate")
async def health_generate(request: Request, engine: ReadyEngine) -> JSONBody:
    leg = getattr(request.app.state, "role", "aggregated")
    start = time.monotonic()
    try:
        async with asyncio.timeout(PROBE_TIMEOUT_S):
            error = await _one_token(engine)
    except TimeoutError:
        error = f"no token within {PROBE_TIMEOUT_S:.0f} s"
    seconds = round(time.monotonic() - start, 4)
    if error is not None:
        return JSONBody({"status": "unavailable", "leg": leg, "error": error, "seconds": seconds}, 503)
    return JSONBody({"status": "ok", "leg": leg, "model": engine.model_name, "seconds": seconds})


async def _one_token(engine: EngineClient) -> str | None:
    """None once the engine produced one token; else what went wrong. Leaving early (timeout)
    closes the engine's stream, which aborts the request and frees its blocks."""
    prompt = list(engine.tokenizer.encode(PROBE_PROMPT))
    probe = GenerateRequest(new_request_id("health"), prompt, SamplingParams(max_tokens=1, temperature=0.0),
                            cache_salt=f"health-{secrets.token_hex(16)}")
    async for output in engine.generate(probe):
        if output.finished:
            if output.finish_reason in ("error", "abort"):
                return output.error or f"the probe ended with {output.finish_reason}"
            return None if output.completion_tokens == 1 else f"{output.completion_tokens} tokens, not 1"
    return "the engine ended the probe without a final output"


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus text exposition of this server's registry."""
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
