"""The OpenAI API: POST /v1/completions, POST /v1/chat/completions, GET /v1/models[/{model}]."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from server.api.builder import check_model
from server.api.deps import Engine, ReadyEngine, json_body
from server.api.generation import answer
from server.openai.formatting import ChatFormatter, CompletionFormatter
from server.openai.protocol import ChatCompletionRequest, CompletionRequest
from server.openai.responses import ModelCard, ModelList
from server.types import EngineClient

router = APIRouter()
CompletionBody = Annotated[CompletionRequest, Depends(json_body(CompletionRequest))]
ChatBody = Annotated[ChatCompletionRequest, Depends(json_body(ChatCompletionRequest))]


@router.post("/v1/completions")
async def create_completion(body: CompletionBody, request: Request, engine: ReadyEngine) -> Response:
    return await answer(request, engine, body, "cmpl", CompletionFormatter)


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatBody, request: Request, engine: ReadyEngine) -> Response:
    return await answer(request, engine, body, "chatcmpl", ChatFormatter)


def _card(engine: EngineClient) -> ModelCard:
    return ModelCard(id=engine.model_name, max_model_len=engine.max_seq_len)


@router.get("/v1/models")
async def list_models(engine: Engine) -> ModelList:
    return ModelList(data=[_card(engine)])


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, engine: Engine) -> ModelCard:
    check_model(model, engine)
    return _card(engine)
