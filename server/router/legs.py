"""The legs of a routed request: one HTTP exchange each with a context or a generation server.

`Legs` runs one leg, not what follows it (server/router/flow.py decides that). A context leg is
tried once more elsewhere if it fails; a generation leg only if its server never took the request.
Every leg holds a booking of its server from the pick until it ends (a stream: until closed). A
server that cannot be reached or is draining is fenced at once. A failed leg raises `LegError`."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace

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
CONTEXT_ONLY = DisaggParams("context_only")


@dataclass
class Upstream:
    """A leg's answer: parsed JSON, or an open SSE stream."""

    backend: Backend
    json: dict | None = None
    stream: StreamResponse | None = None


class Legs:
    def __init__(self, client: HttpClient, context: Sequence[Backend], generation: Sequence[Backend],
                 context_policy: LegPicker, generation_policy: LegPicker, timeout_s: float,
                 auth_token: str | None = None, migration_limit: int = 0) -> None:
        self.headers = token_headers(auth_token)  # every call to a server carries the deployment token
        self.client, self.timeout_s = client, timeout_s
        self.context, self.generation = list(context), list(generation)
        self.context_policy, self.generation_policy = context_policy, generation_policy
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
                          *, kv_stream: bool = False,
                          booked: Callable[[], None] = lambda: None) -> Upstream | EarlyContext:
        """`params`: context_only, with a moved stream's prompt ids and prior output if any. `kv_stream`:
        the server may answer early. `booked` runs when a server is booked (after any queue wait)."""
        ctx_body = {**{k: v for k, v in body.items() if k not in ("stream", "stream_options")}, "stream": False,
                    "disaggregated_params": replace(params, kv_stream=True) if kv_stream else params}
        last = await self._twice(self.context_policy, self.context, prompt, set(), booked,
                                 lambda booking: self._context_once(booking, path, ctx_body, kv_stream),
                                 lambda exc: exc.status >= 500,  # once more elsewhere if it failed
                                 "context leg failed: no healthy context server")
        if isinstance(last, LegError):
            raise LegError(last.status, f"context leg failed: {last}")
        return last

    async def _context_once(self, booking: Booking, path: str, body: dict, kv_stream: bool) -> Upstream | EarlyContext:
        """One try; its booking ends with the answer (an early one: when the leg ends, `EarlyContext.close`)."""
        backend, done = booking.backend, self._ender(booking, "context")
        if not kv_stream:
            answer: dict | EarlyContext = await self._json(backend, path, body)
        else:
            answer = await read_context(backend, await self._send(backend, self.client.stream, path, body), done,
                                        _parse)
        if isinstance(answer, EarlyContext):
            return answer
        done()
        return Upstream(backend, json=answer)

    async def generation_leg(self, path: str, body: dict, prompt: PromptTokens, params: DisaggParams | None,
                             exclude: frozenset[Backend] = frozenset(),
                             booked: Callable[[], None] = lambda: None) -> Upstream:
        """`params`: None for an aggregated server. Another pick if the first never took the request."""
        gen_body = dict(body) if params is None else {**body, "disaggregated_params": params}
        last = await self._twice(self.generation_policy, self.generation, prompt, set(exclude), booked,
                                 lambda booking: self._generation_once(booking, path, gen_body),
                                 lambda exc: exc.untouched, NO_GENERATION)  # another if the first never took it
        if isinstance(last, LegError):
            raise last
        return last

    async def _twice(self, picker: LegPicker, backends: list[Backend], prompt: PromptTokens, tried: set[Backend],
                     booked: Callable[[], None], once: Callable[[Booking], Awaitable],
                     again: Callable[[LegError], bool], none_left: str):
        """The answer of the policy's pick, or of a second pick when `again` says the first failure may
        be retried elsewhere; else that failure. A 503 `none_left` when no server was there to pick. A try
        that fails ends its booking."""
        last: LegError | None = None
        for _ in range(2):
            booking = await picker.pick(backends, prompt, tried)
            if booking is None:
                break
            booked()
            tried.add(booking.backend)
            try:
                return await once(booking)
            except BaseException as exc:
                booking.done()
                if not isinstance(exc, LegError) or not again(exc):
                    raise
                last = exc
        if last is None:
            raise LegError(503, none_left)
        return last

    async def _generation_once(self, booking: Booking, path: str, body: dict) -> Upstream:
        """One try on the booked server; the booking ends with the leg (a stream: when it is closed)."""
        backend, done = booking.backend, self._ender(booking, "generation")
        try:
            if body.get("stream"):
                stream = await self._send(backend, self.client.stream, path, body)
                if stream.status != 200:
                    _parse(backend, await stream.whole())
                return Upstream(backend, stream=_closing(stream, done))
            upstream = Upstream(backend, json=await self._json(backend, path, body))
            done()
            return upstream
        except LegError as exc:
            raise exc.of_leg("generation", backend.url) from exc

    def _ender(self, booking: Booking, leg: str) -> Callable[[], None]:
        """Ends the booking and records the leg's time (once)."""
        start = time.monotonic()

        def done() -> None:
            if booking.done():
                self.observe_leg(leg, time.monotonic() - start)
        return done

    async def release_context(self, backend: Backend, params: DisaggParams) -> None:
        """The generation leg never ran: free the context server's lease now, not at its expiry."""
        try:
            await self.client.request("POST", f"{backend.url}/kv_cache/release", headers=self.headers, timeout=5.0,
                                      json={"ctx_request_id": params.ctx_request_id})
        except HttpError as exc:  # the lease still expires on its own
            log.warning("could not release lease %s on %s: %s", params.ctx_request_id, backend.url, exc)

    async def _json(self, backend: Backend, path: str, body: dict) -> dict:
        return _parse(backend, await self._send(backend, self.client.request, path, body))

    async def _send(self, backend: Backend, call: Callable[..., Awaitable], path: str, body: dict):
        """POST with the client's `request` or `stream`; a connection failure fences the backend."""
        try:
            return await call("POST", backend.url + path, json=body, headers=self.headers, timeout=self.timeout_s)
        except RETRYABLE as exc:
            backend.fence(f"{type(exc).__name__}: {exc}")
            raise LegError(502, f"{backend.url} unreachable ({type(exc).__name__})",
                           untouched=isinstance(exc, ConnectError), lost=isinstance(exc, ReadError)) from exc
        except RequestTimeout as exc:
            raise LegError(504, f"{backend.url} timed out") from exc


def _closing(stream: StreamResponse, done: Callable[[], None]) -> StreamResponse:
    """The same stream; closing it ends the leg (its booking and timing) first."""
    async def close() -> None:
        done()
        await stream.aclose()
    return StreamResponse(stream.status, stream.aiter_raw(), close)


def _parse(backend: Backend, response: Response) -> dict:
    try:
        body = response.json()
    except ValueError:
        body = None
    if response.status == 200 and isinstance(body, dict):
        return body
    error = body.get("error") if isinstance(body, dict) else None
    error = error if isinstance(error, dict) else {}
    message = str(error.get("message") or "") or f"{backend.url} returned HTTP {response.status}"
    status = response.status if response.status != 200 else 502
    draining = status == 503 and error.get("code") == "draining"
    if draining:
        backend.fence("draining")
    raise LegError(status, message, body if isinstance(body, dict) and status < 500 else None, untouched=draining)

