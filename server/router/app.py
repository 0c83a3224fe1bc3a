"""The router's ASGI app: OpenAI endpoints in front of context and generation servers.

A plain Starlette app: the router validates nothing beyond what it routes on (the servers validate
the requests), so FastAPI's request models and dependency layer would only add work to every hop.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import TypeAdapter, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from server.config.router import RouterConfig
from server.dashboard.feed import Dashboard, dashboard_routes
from server.deploy.drain import Drain, DrainGate
from server.openai.errors import error_response, http_error
from server.openai.openapi import openapi_document
from server.openai.wire import JSONBody, loads
from server.router.auth import ApiKeyMiddleware, set_cache_salt
from server.router.backends import Backend, HealthMonitor
from server.router.errors import LegError
from server.router.flow import Ask, ClientGone, Phases, RequestFlow
from server.router.http_client import HttpClient, HttpError
from server.router.legs import Legs
from server.router.policies import Prompt
from server.router.probe import health_generate
from server.router.routing import Routing
from server.telemetry.phases import PHASE_BUCKETS, ROUTER_PHASE_SECONDS, ROUTER_PHASES

CLIENT_DISAGG_PARAMS = ("disaggregated_params is set by the router for its own servers; a client request "
                        "may not carry it")
_BOOL = TypeAdapter(bool)
LEG_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


@dataclass
class RouterState:
    settings: RouterConfig
    client: HttpClient
    legs: Legs  # its context and generation servers are the router's
    monitor: HealthMonitor
    routing: Routing
    tokenizer: object | None = None
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    dashboard: Dashboard | None = None  # GET /dashboard: fed by scrapes after each health round

    def __post_init__(self) -> None:
        self.requests = Counter("pdserve_router_requests", "Requests handled by the router, by outcome",
                                ["outcome"], registry=self.registry)
        self.healthy = Gauge("pdserve_router_backend_healthy", "1 if the backend passes health checks",
                             ["role", "url"], registry=self.registry)
        legs = Histogram("pdserve_router_leg_latency_seconds", "Time of one leg of a request, from sending it "
                         "to its answer (a stream: to its end), by leg", ["leg"], buckets=LEG_BUCKETS,
                         registry=self.registry)
        self.legs.observe_leg = lambda leg, seconds: legs.labels(leg).observe(seconds)
        phases = Histogram(ROUTER_PHASE_SECONDS, "A request's phases in the router, once each: queue, context, "
                           "handoff, first_event (docs/DISAGG_LOAD.md)", ["phase"], buckets=PHASE_BUCKETS,
                           registry=self.registry)
        self.observe_phase = lambda phase, seconds: phases.labels(phase).observe(seconds)
        for phase in ROUTER_PHASES:  # every phase shows from the start
            phases.labels(phase)
        self.migrations = Counter("pdserve_router_migrations", "Streams moved to another generation server "
                                  "after theirs died", registry=self.registry)
        self.legs.on_migration = self.migrations.inc

    def flow(self, path: str, body: dict, chat: bool) -> RequestFlow:
        """A request's flow; it has no context leg when one server serves it alone."""
        prompt = Prompt(lambda: self.prompt_tokens(body, chat), body.get("cache_salt"), _max_tokens(body))
        local = not self.legs.disaggregated or self.routing.serve_locally(prompt, not chat and _several(body),
                                                                          not chat and _prompt_only(body))
        return RequestFlow(self.legs, Ask(path, body, chat, prompt), local, Phases(self.observe_phase))

    def prompt_tokens(self, body: dict, chat: bool) -> Sequence[int] | None:
        if self.tokenizer is None:
            return None
        if chat:
            return self.tokenizer.apply_chat_template(body.get("messages") or [], add_generation_prompt=True,
                                                      tokenize=True, return_dict=False)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else None


def _build_state(settings: RouterConfig) -> RouterState:
    client = HttpClient()
    context = [Backend(_http(u), "context") for u in settings.context_urls]
    generation = [Backend(_http(u), "generation" if context else "aggregated") for u in settings.generation_urls]
    registry = CollectorRegistry()
    routing = Routing(settings, context, generation, registry, client)
    monitor = HealthMonitor(context + generation, client, interval_s=settings.health_interval_s)
    legs = Legs(client, context, generation, routing.context_picker, routing.generation_picker,
                settings.request_timeout_s, settings.auth_token, settings.migration_limit)
    state = RouterState(settings, client, legs, monitor, routing,
                        _load_tokenizer(settings.model) if routing.needs_tokens else None, registry)
    state.dashboard = Dashboard(context + generation, client, state.registry, settings.auth_token)
    monitor.on_round = state.dashboard.scrape_all
    return state


def _load_tokenizer(model: str | None):
    from transformers import AutoTokenizer

    from server.models.builtin import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(model)) if model else None


def _http(url: str) -> str:
    return url if url.startswith("http") else f"http://{url}"


def create_router_app(settings: RouterConfig) -> Starlette:
    """The router of `settings` (`DeploymentConfig.router_config()` for a deployment)."""
    @asynccontextmanager
    async def lifespan(app: Starlette):
        state = _build_state(settings)
        app.state.router = state
        await state.monitor.check_all()
        state.monitor.start()
        if sync := state.routing.sync:  # the servers' KV events, where the policy reads them
            await sync.start()
        yield
        if sync:
            await sync.stop()
        await state.monitor.stop()
        await state.client.aclose()

    drain, access = Drain(settings.drain_timeout_s), settings.access()
    app = Starlette(lifespan=lifespan, exception_handlers={HTTPException: http_error},
                    middleware=[Middleware(ApiKeyMiddleware, access=access),
                                Middleware(DrainGate, drain=drain)], routes=[
        Route("/v1/completions", partial(_handle, path="/v1/completions", chat=False), methods=["POST"]),
        Route("/v1/chat/completions", partial(_handle, path="/v1/chat/completions", chat=True), methods=["POST"]),
        Route("/v1/models", _models, methods=["GET"]),
        Route("/health", _health, methods=["GET"]),
        Route("/health_generate", health_generate, methods=["GET"]),
        Route("/metrics", _metrics, methods=["GET"]),
        *dashboard_routes(),
        Route("/openapi.json", _openapi, methods=["GET"]),
    ])
    app.state.drain, app.state.access = drain, access
    return app


async def _handle(request: Request, path: str, chat: bool) -> Response:
    state: RouterState = request.app.state.router
    try:
        body = loads(await request.body())
    except ValueError as exc:
        return error_response(400, f"malformed JSON body: {exc}")
    if not isinstance(body, dict):
        return error_response(400, "request body must be a JSON object")
    if "disaggregated_params" in body:  # set by the router alone: a client never drives the KV plane
        return error_response(400, CLIENT_DISAGG_PARAMS, code="disaggregated_params_not_allowed")
    try:  # read `stream` as the servers do, so that router and server agree on what is streamed
        body["stream"] = _BOOL.validate_python(body.get("stream", False))
    except ValidationError:
        return error_response(400, f"stream must be a boolean, got {body.get('stream')!r}")
    problem = set_cache_salt(body, request.app.state.access, state.settings.auth_token,
                             getattr(request.state, "api_key", None))
    if problem is not None:
        return error_response(400, problem)
    try:
        response = await state.flow(path, body, chat).respond(request.receive)
    except LegError as exc:
        state.requests.labels("error").inc()
        return JSONBody(exc.body, exc.status)
    except ClientGone:
        state.requests.labels("client_gone").inc()
        return Response(status_code=499)
    state.requests.labels("ok").inc()
    return response


def _several(body: dict) -> bool:
    """A completions body of more than one prompt (strings or token-id lists)."""
    prompt = body.get("prompt")
    return isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str | list) for p in prompt)


def _prompt_only(body: dict) -> bool:
    """A completions body that generates nothing (`max_tokens: 0`, for `echo`): one server serves it
    (and refuses it if not echo)."""
    value = body.get("max_tokens")
    return type(value) is int and value == 0


def _max_tokens(body: dict) -> int:
    """The tokens a request may generate, as its generation leg's share of a server's load."""
    value = body.get("max_completion_tokens", body.get("max_tokens"))
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 16


async def _models(request: Request) -> Response:
    state: RouterState = request.app.state.router
    for backend in state.legs.generation + state.legs.context:
        if backend.healthy:
            try:
                response = await state.client.request("GET", f"{backend.url}/v1/models", timeout=5.0)
                return JSONBody(response.json(), response.status)
            except (HttpError, ValueError):
                continue
    return error_response(503, "no healthy server")


async def _health(request: Request) -> Response:
    if request.app.state.drain.draining:
        return JSONBody(request.app.state.drain.report(), 503)
    state: RouterState = request.app.state.router
    context, generation = state.legs.context, state.legs.generation
    ok = any(b.healthy for b in generation) and (not context or any(b.healthy for b in context))
    detail = {b.url: {"role": b.role, "healthy": b.healthy, "active": b.active, "last_error": b.last_error}
              for b in context + generation}
    return JSONBody({"status": "ok" if ok else "unavailable", "servers": detail}, 200 if ok else 503)


async def _openapi(request: Request) -> Response:
    return JSONBody(openapi_document("pdserve router"))


async def _metrics(request: Request) -> Response:
    state: RouterState = request.app.state.router
    for backend in state.legs.context + state.legs.generation:
        state.healthy.labels(backend.role, backend.url).set(1 if backend.healthy else 0)
    return Response(generate_latest(state.registry), media_type="text/plain; version=0.0.4")
