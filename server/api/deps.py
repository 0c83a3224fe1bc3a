"""FastAPI dependencies: the objects `lifespan` put on `app.state` (tests override these), and who
may drive the KV plane through a server's OpenAI endpoints (docs/SECURITY.md): a request with
`disaggregated_params` needs the deployment token, and a generation_only one may only name the KV
endpoint of one of this deployment's context servers (`ContextDirectory`). Both checks run before
anything reaches the engine: a refused request pins nothing and connects nowhere.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, TypeVar

from fastapi import Depends, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from server.auth import TOKEN_HEADER, missing_token_message, token_matches
from server.openai.errors import APIError
from server.openai.protocol import DisaggParams
from server.types import EngineClient

M = TypeVar("M", bound=BaseModel)
PARAM = "disaggregated_params"


def json_body(model: type[M]) -> Callable[[Request], Awaitable[M]]:
    """Parse the body as JSON into `model` whatever the Content-Type (`curl -d` sends a form type)."""

    async def parse(request: Request) -> M:
        raw = await request.body()
        if not raw.strip():
            raise APIError(400, "the request body is empty: send a JSON object")
        try:
            return model.model_validate_json(raw)
        except ValidationError as exc:
            raise RequestValidationError(exc.errors(include_url=False, include_context=False)) from None

    return parse


def get_engine(request: Request) -> EngineClient:
    return request.app.state.engine


def get_ready_engine(request: Request) -> EngineClient:
    """The engine, or a 503 while it is still loading."""
    engine = get_engine(request)
    if engine is None or not engine.is_ready():
        raise APIError(503, "the engine is not ready yet (model loading)", code="not_ready")
    return engine


Engine = Annotated[EngineClient, Depends(get_engine)]
ReadyEngine = Annotated[EngineClient, Depends(get_ready_engine)]


def require_token(request: Request, what: str) -> None:
    """401 unless the request carries this server's deployment token."""
    token = getattr(request.app.state, "auth_token", None)
    if not token_matches(request.headers.get(TOKEN_HEADER), token):
        raise APIError(401, missing_token_message(token, what), code="unauthorized")


async def check_disagg_access(request: Request, params: DisaggParams | None) -> None:
    if params is None:
        return
    require_token(request, PARAM)
    if params.request_type != "generation_only" or params.ctx_endpoint is None:
        return  # a generation_only request without an endpoint is refused by the engine (400)
    directory = getattr(request.app.state, "context_directory", None)
    if directory is None or not await directory.knows(params.ctx_endpoint):
        raise APIError(403, f"{PARAM}.ctx_endpoint {params.ctx_endpoint!r} is not the KV endpoint of a "
                       "context server of this deployment; this server pulls from no other address",
                       param=f"{PARAM}.ctx_endpoint", code="unknown_context_server")
