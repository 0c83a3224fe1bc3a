"""GET /health_generate on the router: a readiness probe that runs one real request through the
deployment — context leg (prefill, first token), KV transfer, generation leg (one more token) —
and names the leg that failed.

The probe is an ordinary two-token completion under a fresh `cache_salt`, so neither server reuses
a cached block (the transfer really moves KV) and none is left for any tenant. A failed generation
leg is told apart from a failed transfer by asking that generation server to run one token by
itself (its own `/health_generate`): if it can, what failed was the transfer between the two.
503 `{"status": "unavailable", "leg": "context" | "transfer" | "generation", "server", "error"}`;
200 `{"status": "ok", "context": url, "generation": url, "seconds"}`.
"""

from __future__ import annotations

import asyncio
import secrets
import time

from starlette.requests import Request

from server.openai.wire import JSONBody
from server.router.answers import context_finished, generation_params
from server.router.errors import LegError
from server.router.http_client import HttpError
from server.router.legs import Legs
from server.router.policies import Prompt

PATH = "/v1/completions"
PROBE_TIMEOUT_S = 60.0
PROBE_SERVER_TIMEOUT_S = 30.0


class ProbeFailed(Exception):
    def __init__(self, leg: str, error: str, server: str | None = None) -> None:
        super().__init__(error)
        self.leg, self.error, self.server = leg, error, server


def probe_body() -> dict:
    return {"prompt": "pdserve readiness probe", "max_tokens": 2, "temperature": 0.0, "ignore_eos": True,
            "cache_salt": f"health-{secrets.token_hex(16)}"}


async def health_generate(request: Request) -> JSONBody:
    state = request.app.state.router
    start = time.monotonic()
    where = {"leg": "context" if state.legs.disaggregated else "generation", "server": None}
    try:
        async with asyncio.timeout(PROBE_TIMEOUT_S):
            used = await _run(state.legs, where)
    except ProbeFailed as exc:
        return _failed(exc.leg, exc.error, exc.server, start)
    except TimeoutError:
        return _failed(where["leg"], f"no answer within {PROBE_TIMEOUT_S:.0f} s", where["server"], start)
    return JSONBody({"status": "ok", **used, "seconds": round(time.monotonic() - start, 4)})


def _failed(leg: str, error: str, server: str | None, start: float) -> JSONBody:
    return JSONBody({"status": "unavailable", "leg": leg, "server": server, "error": error,
                         "seconds": round(time.monotonic() - start, 4)}, 503)


async def _run(orch: Legs, where: dict) -> dict:
    body, prompt = probe_body(), Prompt(lambda: None)
    if not orch.disaggregated:  # aggregated servers behind the router: one server does it all
        upstream = await _generation(orch, body, prompt, None, where)
        return {"generation": upstream.backend.url}
    if not any(b.healthy for b in orch.generation):
        raise ProbeFailed("generation", "no healthy generation server")
    try:
        ctx = await orch.context_leg(PATH, body, prompt)
    except LegError as exc:
        raise ProbeFailed("context", str(exc)) from exc
    where.update(leg="generation", server=ctx.backend.url)  # the generation leg includes the transfer
    if context_finished(ctx.json):
        raise ProbeFailed("context", "the context server ended the probe instead of handing it over",
                          ctx.backend.url)
    params = generation_params(ctx.json, first_text_streamed=False)
    try:
        upstream = await _generation(orch, body, prompt, params, where)
    except BaseException:
        await asyncio.shield(orch.release_context(ctx.backend, params))
        raise
    return {"context": ctx.backend.url, "generation": upstream.backend.url}


async def _generation(orch: Legs, body: dict, prompt: Prompt, params: dict | None, where: dict):
    backend = orch.generation_policy.choose(orch.generation, prompt, set())
    if backend is None:
        raise ProbeFailed("generation", "no healthy generation server")
    where["server"] = backend.url
    try:
        return await orch.generation_leg(PATH, body, prompt, params, backend=backend)
    except LegError as exc:
        leg = "generation"
        if params is not None and await _runs_alone(orch, backend.url):
            leg = "transfer"  # that server generates by itself: the pair failed between the two
        raise ProbeFailed(leg, str(exc), backend.url) from exc


async def _runs_alone(orch: Legs, url: str) -> bool:
    try:
        response = await orch.client.request("GET", f"{url}/health_generate", headers=orch.headers,
                                             timeout=PROBE_SERVER_TIMEOUT_S)
    except HttpError:
        return False
    return response.status == 200
