"""Context-first orchestration of one request across a context and a generation server.

1. pick a context server, send the request as `context_only` (non-streaming); retry once elsewhere
   if that server cannot be reached or fails;
2. if the context answer already finishes the request, return it;
3. else send it as `generation_only` with the returned `disaggregated_params` to a generation
   server and hand its JSON or SSE stream back to the client; a generation server that cannot be
   reached or is draining (503, code `draining`) took nothing, so the leg goes to another one.
A leg that fails ends the request with a 502/503 naming the leg. A server that cannot be reached or
answers that it is draining is fenced at once (the health monitor unfences it when /health is 200).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace

from pydantic import TypeAdapter

from server.auth import token_headers
from server.openai.protocol import DisaggParams
from server.router.backends import Backend
from server.router.errors import LegError
from server.router.http_client import (
    ConnectError,
    HttpClient,
    HttpError,
    ReadError,
    RequestTimeout,
    Response,
    StreamResponse,
)
from server.router.kv_stream import EarlyContext, read_context
from server.router.policies import PromptTokens
from server.router.queue import Booking, LegPicker

log = logging.getLogger(__name__)
RETRYABLE = (ConnectError, ReadError)  # the server is gone or broke the exchange: fence it
NO_GENERATION = "generation leg failed: no healthy generation server"
_PARAMS = TypeAdapter(DisaggParams)
CONTEXT_ONLY = DisaggParams("context_only")


@dataclass
class Upstream:
    """A response from a backend: either parsed JSON or an open SSE stream."""

    backend: Backend
    json: dict | None = None
    stream: StreamResponse | None = None


class Orchestrator:
    def __init__(self, client: HttpClient, context: Sequence[Backend], generation: Sequence[Backend],
                 context_policy: LegPicker, generation_policy: LegPicker, timeout_s: float,
                 auth_token: str | None = None, migration_limit: int = 0) -> None:
        self.headers = token_headers(auth_token)  # every call to a server carries the deployment token
        self.client = client
        self.context = list(context)
        self.generation = list(generation)
        self.context_policy = context_policy
        self.generation_policy = generation_policy
        self.timeout_s = timeout_s
        # (leg, seconds) of every leg that answered: "context", "generation" (a stream: until it closed)
        self.observe_leg: Callable[[str, float], None] = lambda leg, seconds: None
        self.migration_limit = migration_limit  # moves of one stream to another generation server
        self.on_migration: Callable[[], None] = lambda: None  # counts them (the router's metrics)

    @property
    def disaggregated(self) -> bool:
        return bool(self.context)

    def require_generation(self) -> None:
        """Fail before the context leg when no generation server is healthy: a prefill whose KV
        nobody can pull would only hold the context server's blocks until its lease expires."""
        if not any(b.healthy for b in self.generation):
            raise LegError(503, NO_GENERATION)

    async def context_leg(self, path: str, body: dict, prompt: PromptTokens, params: DisaggParams = CONTEXT_ONLY,
                          *, kv_stream: bool = False) -> Upstream | EarlyContext:
        """`params`: context_only, with a moved stream's prompt ids and prior output if any.
        `kv_stream`: the server may answer early, before its first token (server/router/kv_stream.py)."""
        ctx_body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        ctx_body["stream"] = False
        ctx_body["disaggregated_params"] = replace(params, kv_stream=True) if kv_stream else params
        tried: set[Backend] = set()
        last: LegError | None = None
        for _ in range(2):  # the first choice and one retry elsewhere
            booking = await self.context_policy.pick(self.context, prompt, tried)  # may queue (queue.py)
            if booking is None:
                break
            tried.add(booking.backend)
            try:
                return await self._context_once(booking, path, ctx_body, kv_stream)
            except LegError as exc:
                if exc.status < 500:
                    raise
                last = exc
        if last is not None:
            raise LegError(last.status, f"context leg failed: {last}")
        raise LegError(503, "context leg failed: no healthy context server")

    async def _context_once(self, booking: Booking, path: str, body: dict, kv_stream: bool) -> Upstream | EarlyContext:
        """One try; its booking ends with the answer (an early one: when the leg ends, `EarlyContext.close`)."""
        backend, start = booking.backend, time.monotonic()

        def done() -> None:
            booking.done()
            self.observe_leg("context", time.monotonic() - start)

        try:
            if not kv_stream:
                answer: dict | EarlyContext = await self._post_json(backend, path, body)
            else:
                answer = await read_context(backend, await self._open(backend, path, body), done, _parse)
        except BaseException:
            booking.done()
            raise
        if isinstance(answer, EarlyContext):
            return answer
        done()
        return Upstream(backend, json=answer)

    async def generation_leg(self, path: str, body: dict, prompt: PromptTokens, params: DisaggParams | None,
                             exclude: frozenset[Backend] = frozenset(), backend: Backend | None = None) -> Upstream:
        """`backend`: this one rather than the policy's pick (the readiness probe); else the policy's
        pick, and another if the first never took the request."""
        gen_body = dict(body)
        if params is not None:
            gen_body["disaggregated_params"] = params
        stream = bool(body.get("stream"))
        picker = self.generation_policy
        if backend is not None:
            return await self._generation_once(picker.book(backend, prompt), path, gen_body, stream)
        tried: set[Backend] = set(exclude)
        last: LegError | None = None
        for _ in range(2):  # the first choice, and another if the first never took the request
            booking = await picker.pick(self.generation, prompt, tried)  # may queue (queue.py)
            if booking is None:
                break
            tried.add(booking.backend)
            try:
                return await self._generation_once(booking, path, gen_body, stream)
            except LegError as exc:
                if not exc.untouched:
                    raise
                last = exc
        if last is not None:
            raise last
        raise LegError(503, NO_GENERATION)

    async def _generation_once(self, booking: Booking, path: str, body: dict, stream: bool) -> Upstream:
        """One try on the booked server; the booking ends with the leg (a stream: when it is closed)."""
        backend, start = booking.backend, time.monotonic()
        if stream:
            try:
                opened = await self._open_stream(backend, path, body)
            except BaseException:
                booking.done()
                raise
            return Upstream(backend, stream=self._timed(opened, start, booking.done))
        try:
            upstream = Upstream(backend, json=await self._post_json(backend, path, body))
            self.observe_leg("generation", time.monotonic() - start)
            return upstream
        except LegError as exc:
            kept = exc.body if exc.status < 500 else None
            raise LegError(exc.status, f"generation leg failed: {exc}", kept, untouched=exc.untouched) from exc
        finally:
            booking.done()

    def _timed(self, stream: StreamResponse, start: float, done: Callable[[], None]) -> StreamResponse:
        """The same stream; closing it records the generation leg's time and ends its booking (once)."""
        async def close() -> None:
            done()
            self.observe_leg("generation", time.monotonic() - start)
            await stream.aclose()
        return StreamResponse(stream.status, stream.aiter_raw(), close)

    async def release_context(self, backend: Backend, params: DisaggParams) -> None:
        """The generation leg never ran: free the context server's lease now, not at its expiry."""
        try:
            await self.client.request("POST", f"{backend.url}/kv_cache/release", headers=self.headers, timeout=5.0,
                                      json={"ctx_request_id": params.ctx_request_id})
        except HttpError as exc:  # the lease still expires on its own
            log.warning("could not release lease %s on %s: %s", params.ctx_request_id, backend.url, exc)

    async def _post_json(self, backend: Backend, path: str, body: dict) -> dict:
        return _parse(backend, await self._send(backend, self.client.request, path, body))

    async def _open(self, backend: Backend, path: str, body: dict) -> StreamResponse:
        """A POST whose body is read as it arrives (any status)."""
        return await self._send(backend, self.client.stream, path, body)

    async def _send(self, backend: Backend, call: Callable[..., Awaitable], path: str, body: dict):
        """POST with the client's `request` or `stream`; a connection failure fences the backend."""
        try:
            return await call("POST", backend.url + path, json=body, headers=self.headers, timeout=self.timeout_s)
        except RETRYABLE as exc:
            backend.fence(f"{type(exc).__name__}: {exc}")
            raise LegError(502, f"{backend.url} unreachable ({type(exc).__name__})",
                           untouched=isinstance(exc, ConnectError)) from exc
        except RequestTimeout as exc:
            raise LegError(504, f"{backend.url} timed out") from exc

    async def _open_stream(self, backend: Backend, path: str, body: dict) -> StreamResponse:
        try:
            response = await self.client.stream("POST", backend.url + path, json=body, headers=self.headers,
                                                timeout=self.timeout_s)
            if response.status != 200:
                try:
                    _parse(backend, Response(response.status, await response.aread()))
                finally:
                    await response.aclose()
        except RETRYABLE as exc:
            backend.fence(f"{type(exc).__name__}: {exc}")
            error = LegError(502, f"generation leg failed: {backend.url} unreachable",
                             untouched=isinstance(exc, ConnectError))
            error.lost = isinstance(exc, ReadError)
            raise error from exc
        except RequestTimeout as exc:
            raise LegError(504, f"generation leg failed: {backend.url} timed out") from exc
        return response


def _parse(backend: Backend, response: Response) -> dict:
    try:
        body = response.json()
    except ValueError:
        body = None
    if response.status == 200 and isinstance(body, dict):
        return body
    message = _message(body) or f"{backend.url} returned HTTP {response.status}"
    status = response.status if response.status != 200 else 502
    draining = status == 503 and _code(body) == "draining"
    if draining:
        backend.fence("draining")
    raise LegError(status, message, body if isinstance(body, dict) and status < 500 else None, untouched=draining)


def _code(body: object) -> str | None:
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return body["error"].get("code")
    return None


def _message(body: object) -> str | None:
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message"))
    return None


def context_params(ctx: dict) -> DisaggParams:
    """The `disaggregated_params` of an unfinished context answer."""
    return _PARAMS.validate_python(ctx["choices"][0]["disaggregated_params"])


def context_finished(ctx: dict) -> bool:
    """The context answer is final when it carries no parameters for a generation leg."""
    choices = ctx.get("choices") or [{}]
    params = choices[0].get("disaggregated_params") or {}
    return not params.get("ctx_request_id")
