"""POST /v1/chat/completions."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from server.api.deps import ReadyEngine, json_body
from server.api.generation import answer
from server.openai.formatting import ChatFormatter
from server.openai.protocol import ChatCompletionRequest

router = APIRouter()
Body = Annotated[ChatCompletionRequest, Depends(json_body(ChatCompletionRequest))]


@router.post("/v1/chat/completions")
async def create_chat_completion(body: Body, request: Request, engine: ReadyEngine) -> Response:
    return await answer(request, engine, body, "chatcmpl", ChatFormatter)
