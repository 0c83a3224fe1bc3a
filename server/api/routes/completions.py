"""POST /v1/completions."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from server.api.deps import get_ready_engine
from server.api.formatting import CompletionFormatter
from server.api.generation import respond_json, respond_stream
from server.api.prompts import build_request, new_request_id
from server.api.protocol import CompletionRequest
from server.types import EngineClient

router = APIRouter()


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request,
                            engine: Annotated[EngineClient, Depends(get_ready_engine)]) -> Response:
    request_id = new_request_id("cmpl")
    gen = build_request(body, engine, request_id)
    fmt = CompletionFormatter(request_id, engine.model_name, include_usage=body.include_usage)
    respond = respond_stream if body.stream else respond_json
    return await respond(request, engine, gen, fmt)
