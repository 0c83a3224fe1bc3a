"""GET /health_generate on the router: one real two-token request through the deployment as a
`RequestFlow`, under a fresh `cache_salt` (the transfer really moves KV), naming the leg that failed.

A failed generation leg is told apart from a failed transfer by asking that generation server to
run one token by itself (its own `/health_generate`)."""

from __future__ import annotations

import asyncio
import secrets
import time

from starlette.requests import Request

from server.openai.wire import JSONBody
from server.router.errors import LegError
from server.router.flow import Ask, RequestFlow
from server.router.http_client import HttpError
from server.router.legs import Legs
from server.router.policies import Prompt

PATH = "/v1/completions"
PROBE_TIMEOUT_S = 60.0
PROBE_SERVER_TIMEOUT_S = 30.0


async def health_generate(request: Request) -> JSONBody:
    legs = request.app.state.router.legs
    start = time.monotonic()
    body = {"prompt": "pdserve readiness probe", "max_tokens": 2, "temperature": 0.0, "ignore_eos": True,
            "cache_salt": f"health-{secrets.token_hex(16)}"}
    flow = RequestFlow(legs, Ask(PATH, body, chat=False, prompt=Prompt(lambda: None)), local=not legs.disaggregated)
    try:
        async with asyncio.timeout(PROBE_TIMEOUT_S):
            failed = await _run(legs, flow)
    except TimeoutError:
        failed = _leg(flow), f"no answer within {PROBE_TIMEOUT_S:.0f} s", flow.servers.get("context")
    finally:
        await asyncio.shield(flow.close())  # a lease no generation leg opened on is released
    seconds = round(time.monotonic() - start, 4)
    if failed is None:
        return JSONBody({"status": "ok", **flow.servers, "seconds": seconds})
    leg, error, server = failed
    return JSONBody({"status": "unavailable", "leg": leg, "server": server, "error": error, "seconds": seconds}, 503)


def _leg(flow: RequestFlow) -> str:
    """The leg the flow is in: the generation leg (with the transfer) once the context leg answered."""
    return "generation" if flow.local or "context" in flow.servers else "context"


async def _run(legs: Legs, flow: RequestFlow) -> tuple[str, str, str | None] | None:
    """None when the probe went through both legs; else (the leg that failed, what went wrong, its server)."""
    if not any(b.healthy for b in legs.generation):
        return "generation", "no healthy generation server", None
    try:
        await flow.answer()
    except LegError as exc:
        leg = _leg(flow)
        if leg == "generation" and not flow.local and exc.server and await _runs_alone(legs, exc.server):
            leg = "transfer"  # that server generates by itself: the pair failed between the two
        return leg, str(exc), exc.server
    if "generation" not in flow.servers:
        return "context", "the context server ended the probe instead of handing it over", flow.servers.get("context")
    return None


async def _runs_alone(legs: Legs, url: str) -> bool:
    try:
        response = await legs.client.request("GET", f"{url}/health_generate", headers=legs.headers,
                                             timeout=PROBE_SERVER_TIMEOUT_S)
    except HttpError:
        return False
    return response.status == 200
