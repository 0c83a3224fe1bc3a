"""POST /v1/completions."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from server.api.deps import get_ready_engine, json_body
from server.api.formatting import CompletionFormatter
from server.api.generation import respond_json, respond_stream
from server.api.prompts import build_request, new_request_id
from server.api.protocol import CompletionRequest
from server.types import EngineClient

router = APIRouter()
Body = Annotated[CompletionRequest, Depends(json_body(CompletionRequest))]
ReadyEngine = Annotated[EngineClient, Depends(get_ready_engine)]


@router.post("/v1/completions")
async def create_completion(body: Body, request: Request, engine: ReadyEngine) -> Response:
    request_id = new_request_id("cmpl")
    gen = build_request(body, engine, request_id)
    fmt = CompletionFormatter(request_id, engine.model_name, include_usage=body.include_usage)
    respond = respond_stream if body.stream else respond_json
    return await respond(request, engine, gen, fmt)
