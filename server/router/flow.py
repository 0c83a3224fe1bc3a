"""One request's way through the router, as one object: route -> context leg -> handoff ->
generation leg -> relay -> close.

A request one server serves alone has no context leg. An early context answer (streamed KV) starts
the generation leg before the first token. The handoff is decided here only (`_handoff`). When the
generation server dies mid-stream, the flow runs the legs again from the tokens the client has
(server/router/migration.py). `close` runs however the request ended: the generation leg is
cancelled or closed, a lease no generation leg opened on is released. Once the first event is out
the status is 200, so a later failure is an error event naming the leg."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace

from starlette.responses import Response
from starlette.types import Receive

from server.openai.errors import error_body
from server.openai.formatting import continued_response_id
from server.openai.protocol import DisaggParams
from server.openai.sse import DONE, EventStream, json_event, unless_disconnected
from server.openai.wire import JSONBody
from server.router.answers import (
    closing_events,
    context_finished,
    context_params,
    final_answer,
    opening_events,
)
from server.router.backends import Backend
from server.router.errors import LegError
from server.router.http_client import HttpError
from server.router.kv_stream import EarlyContext
from server.router.legs import Legs, Upstream
from server.router.migration import EventTracker, Migration
from server.router.policies import Prompt, PromptTokens

MID_STREAM = 500  # the status an error event's type is named after: the stream itself is a 200


class ClientGone(Exception):
    pass


@dataclass(frozen=True)
class Ask:
    """What the client asked, as the router routes it."""

    path: str
    body: dict
    chat: bool
    prompt: Prompt

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    @property
    def include_usage(self) -> bool:
        return bool((self.body.get("stream_options") or {}).get("include_usage"))

    @property
    def plain(self) -> bool:
        """One choice whose chunks carry text only: the router may stream its first token itself (and
        move the stream); anything else the generation server formats from its first chunk on."""
        body = self.body
        tools = body.get("tools") and body.get("tool_choice") != "none"
        return (body.get("n") in (None, 1) and body.get("logprobs") in (None, False)
                and not body.get("echo") and not tools)


class Phases:
    """A request's phases in the router, once each (first stamps count): queue (arrival -> a leg booked),
    context (-> the context answer), handoff (-> the generation leg's stream open; 0 if it opened first;
    none for a JSON leg, answered after its decode), generation (a stream's generation leg started -> its
    first event relayed: how soon the generation server speaks), first_event (arrival -> the first event
    sent, or the JSON answer)."""

    SPANS = {"queue": ("start", "booked"), "context": ("booked", "answered"), "handoff": ("answered", "opened"),
             "generation": ("handed", "relayed"), "first_event": ("start", "sent")}

    def __init__(self, observe: Callable[[str, float], None] = lambda phase, seconds: None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.observe, self.clock = observe, clock
        self._at = {"start": clock()}

    def stamp(self, event: str) -> None:
        """`event` happens now: observe the phases it completes."""
        if event not in self._at:
            self._at[event] = self.clock()
            for phase, (since, until) in self.SPANS.items():
                if event in (since, until) and since in self._at and until in self._at:
                    self.observe(phase, max(0.0, self._at[until] - self._at[since]))


class RequestFlow:
    def __init__(self, legs: Legs, ask: Ask, local: bool, phases: Phases | None = None) -> None:
        self.legs, self.ask = legs, ask
        self.local = local  # one server serves it all (aggregated, or routed so): no context leg
        self.phases = phases or Phases()
        self._lease: tuple[Backend, DisaggParams] | None = None  # held for the latest generation leg
        self._generation: asyncio.Future[Upstream] | None = None
        self._early: EarlyContext | None = None
        self._migration: Migration | None = None
        self._closed = False
        self.servers: dict[str, str] = {}  # the server of each leg that answered: "context", "generation"

    async def respond(self, receive: Receive) -> Response:
        """The client's response; `ClientGone` if the client left first. A stream's response closes the
        flow when it ends; every other way out closes it here."""
        try:
            done, response = await unless_disconnected(self.answer, receive)
            if not done:
                raise ClientGone()
        except BaseException:
            await asyncio.shield(self.close())
            raise
        if isinstance(response, EventStream):
            response.events = self._sent(response.events)
        else:
            self.phases.stamp("sent")
        return response

    async def _sent(self, events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        try:
            async for event in events:
                self.phases.stamp("sent")
                yield event
        finally:
            await events.aclose()  # the flow's events are async generators: closed as EventStream would

    async def answer(self) -> Response:
        """The response, without watching the client (`respond` does; so does a fan-out of flows)."""
        if self.local:
            return await self._generation_answer(None)
        self.legs.require_generation()
        backend, ctx = await self._context()
        self.phases.stamp("answered")
        if context_finished(ctx):  # the context leg ended the request: no lease to hand over
            self._lease = None
            await self.close()
            return final_answer(ctx, self.ask.chat, self.ask.stream, self.ask.include_usage)
        if self._generation is None:
            self._start(backend, self._handoff(context_params(ctx)))
        return await self._generation_answer(ctx)

    async def _context(self) -> tuple[Backend, dict]:
        """The context server and its answer; an early one (streamed KV) starts the generation leg meanwhile."""
        # streamed KV brings the first tokens with the KV, not the logprobs the context server computed
        kv_stream = self.ask.body.get("logprobs") in (None, False) and not self.ask.body.get("echo")
        answer = await self.legs.context_leg(self.ask.path, self.ask.body, self.ask.prompt, kv_stream=kv_stream,
                                             booked=lambda: self.phases.stamp("booked"))
        self.servers["context"] = answer.backend.url
        if isinstance(answer, Upstream):
            return answer.backend, answer.json
        self._early = answer
        self._start(answer.backend, self._handoff(answer.params))
        return answer.backend, await answer.rest()

    def _handoff(self, params: DisaggParams, moved: bool = False) -> DisaggParams:
        """The generation leg's parameters (built here only) from the context leg's."""
        opens = self.ask.stream and self.ask.plain
        params = replace(params, request_type="generation_only", first_text_streamed=opens,
                         report_tokens=opens and self.legs.migration_limit > 0)
        return self._migration.continued(params) if moved else params

    def _start(self, backend: Backend | None, params: DisaggParams | None, prompt: PromptTokens | None = None) -> None:
        self._lease = (backend, params) if backend is not None and params is not None else None
        self.phases.stamp("handed")
        dead = frozenset(self._migration.dead) if self._migration is not None else frozenset()
        self._generation = asyncio.ensure_future(self.legs.generation_leg(
            self.ask.path, self.ask.body, prompt or self.ask.prompt, params, exclude=dead,
            booked=lambda: self.phases.stamp("booked")))
        self._generation.add_done_callback(self._opened)

    def _opened(self, leg: asyncio.Future[Upstream]) -> None:
        if not leg.cancelled() and leg.exception() is None:
            self.servers["generation"] = leg.result().backend.url
            if leg.result().stream is not None:
                self.phases.stamp("opened")

    async def _generation_answer(self, ctx: dict | None) -> Response:
        if self._generation is None:
            self._start(None, None)
        if not self.ask.stream:
            upstream = await self._generation
            await self.close()
            return JSONBody(upstream.json)
        if ctx is None or not self.ask.plain:  # nothing sent yet: a leg that fails to open gets its HTTP status
            await self._generation
            return EventStream(self._events([]), self.close)
        if self.legs.migration_limit > 0:
            params = context_params(ctx)
            self._migration = Migration(continued_response_id(params.ctx_request_id),
                                        list(params.prompt_token_ids or ()), list(params.first_gen_tokens or ()),
                                        self.legs.migration_limit)
        return EventStream(self._events(opening_events(ctx, self.ask.chat)), self.close)

    async def _events(self, opening: list[bytes]) -> AsyncIterator[bytes]:
        """The stream: the router's opening events, then the generation leg's, moved if it dies."""
        for event in opening:
            yield event
        while self._generation is not None:
            leg = self._generation
            try:
                upstream = await leg
            except Exception as exc:  # the generation leg failed before its stream opened
                if isinstance(exc, LegError) and exc.lost and self._may_move(None):
                    async for event in self._move():
                        yield event
                    continue
                yield json_event(_leg_error(exc))
                yield DONE
                return
            async for event in self._relay(upstream):
                yield event
            if self._generation is leg:  # it did not move: the stream has ended
                return

    async def _relay(self, upstream: Upstream) -> AsyncIterator[bytes]:
        """One generation leg's events; on a broken stream, move the request on or end with an error."""
        tracker = EventTracker(self._migration.tokens) if self._migration is not None else None
        try:
            async for chunk in upstream.stream.aiter_raw():
                self.phases.stamp("relayed")
                if out := (tracker.feed(chunk) if tracker is not None else chunk):
                    yield out
            return
        except HttpError as exc:
            failure = f"generation leg failed mid-stream: {type(exc).__name__}"
        finally:
            await upstream.stream.aclose()  # ends the leg's booking (server/router/queue.py)
        upstream.backend.fence(failure)
        if tracker is not None and tracker.finished:  # everything was generated; only the end was lost
            yield DONE
        elif self._may_move(upstream.backend):
            async for event in self._move():
                yield event
        else:
            yield _mid_stream_error(failure)

    def _may_move(self, dead: Backend | None) -> bool:
        if self._migration is None:
            return False
        if dead is not None:
            self._migration.dead.add(dead)
        return self._migration.possible(self.legs.generation)

    async def _move(self) -> AsyncIterator[bytes]:
        """Steps 2-4 again from the tokens the client has: a context leg, its first text, a generation leg."""
        migration = self._migration
        self.legs.on_migration()
        params = migration.context_params()
        prompt = params.prompt_token_ids
        self._generation, self._lease = None, None
        try:
            ctx = await self.legs.context_leg(self.ask.path, self.ask.body, lambda: prompt, params)
        except LegError as exc:
            yield _mid_stream_error(f"generation leg failed mid-stream and could not move on: {exc}")
            yield DONE
            return
        if context_finished(ctx.json):  # that context leg finished the request
            for event in closing_events(ctx.json, self.ask.chat, migration.response_id, self.ask.include_usage,
                                        continued=True):
                yield event
            return
        events = opening_events(ctx.json, self.ask.chat, migration.response_id, continued=True)
        params = self._handoff(context_params(ctx.json), moved=True)
        ids = params.prompt_token_ids
        self._start(ctx.backend, params, lambda: ids)
        for event in events:
            yield event

    async def close(self) -> None:
        """Idempotent; run it shielded from cancellation (`EventStream` does)."""
        if self._closed:
            return
        self._closed = True
        leg, self._generation = self._generation, None
        opened = None
        if leg is not None:
            leg.cancel()  # no-op once done
            opened = (await asyncio.gather(leg, return_exceptions=True))[0]
        if isinstance(opened, Upstream):
            if opened.stream is not None:
                await opened.stream.aclose()  # idempotent; the relay may have closed it already
        elif self._lease is not None:  # the latest generation leg never opened: nothing will pull the lease
            await self.legs.release_context(*self._lease)
        if self._early is not None:
            await self._early.close()


def _mid_stream_error(message: str) -> bytes:
    return json_event(error_body(MID_STREAM, message))


def _leg_error(exc: Exception) -> dict:
    """The error event's body: the generation server's own error, said to come from that leg."""
    if not isinstance(exc, LegError):
        return error_body(MID_STREAM, f"generation leg failed: {type(exc).__name__}: {exc}")
    error = dict(exc.body.get("error") or {})
    body = {**exc.body, "error": error}
    message = str(error.get("message") or exc)
    if not message.startswith("generation leg failed"):
        message = f"generation leg failed (HTTP {exc.status}): {message}"
    error["message"] = message
    return body
