"""POST /v1/completions."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from server.api.deps import ReadyEngine, json_body
from server.api.generation import answer
from server.openai.formatting import CompletionFormatter
from server.openai.protocol import CompletionRequest

router = APIRouter()
Body = Annotated[CompletionRequest, Depends(json_body(CompletionRequest))]


@router.post("/v1/completions")
async def create_completion(body: Body, request: Request, engine: ReadyEngine) -> Response:
    return await answer(request, engine, body, "cmpl", CompletionFormatter)
