"""GET /v1/models and /v1/models/{model}."""

from __future__ import annotations

from fastapi import APIRouter

from server.api.builder import check_model
from server.api.deps import Engine
from server.openai.responses import ModelCard, ModelList
from server.types import EngineClient

router = APIRouter()


def _card(engine: EngineClient) -> ModelCard:
    return ModelCard(id=engine.model_name, max_model_len=engine.max_seq_len)


@router.get("/v1/models")
async def list_models(engine: Engine) -> ModelList:
    return ModelList(data=[_card(engine)])


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, engine: Engine) -> ModelCard:
    check_model(model, engine)
    return _card(engine)
