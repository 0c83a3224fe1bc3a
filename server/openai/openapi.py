"""The OpenAPI document of pdserve's OpenAI surface, shared by the servers and the router.

Built from the pydantic models the servers validate with, so it cannot drift from what is accepted
(FastAPI's own shows no request bodies: they are parsed by `json_body`). Fuzz tests feed it to
schemathesis."""

from __future__ import annotations

import functools

from server.openai.protocol import ChatCompletionRequest, CompletionRequest

REF = "#/components/schemas/{model}"
ERROR = {
    "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type", "param", "code"],
                             "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                                            "param": {"type": ["string", "null"]},
                                            "code": {"type": ["string", "null"]}}}},
}


def _errors(*statuses: int) -> dict:
    content = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    return {str(s): {"description": "an error in OpenAI's shape", "content": content} for s in statuses}


def _generation(model: type, summary: str) -> dict:
    body = {"required": True, "content": {"application/json": {"schema": {"$ref": REF.format(model=model.__name__)}}}}
    ok = {"description": "JSON, or an SSE stream of chunks when `stream` is true",
          "content": {"application/json": {"schema": {"type": "object"}},
                      "text/event-stream": {"schema": {"type": "string"}}}}
    return {"post": {"summary": summary, "requestBody": body,
                     "responses": {"200": ok, **_errors(400, 401, 403, 404, 409, 502, 503, 504)}}}


def _get(summary: str, media: str = "application/json") -> dict:
    return {"get": {"summary": summary, "responses": {"200": {"description": "ok", "content": {
        media: {"schema": {"type": "object"} if media == "application/json" else {"type": "string"}}}},
        **_errors(503)}}}


@functools.cache
def openapi_document(title: str = "pdserve") -> dict:
    schemas: dict = {"Error": ERROR}
    for model in (CompletionRequest, ChatCompletionRequest):
        schema = model.model_json_schema(ref_template=REF)
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": "1"},
        "paths": {
            "/v1/completions": _generation(CompletionRequest, "a completion (text or token ids in, text out)"),
            "/v1/chat/completions": _generation(ChatCompletionRequest, "a chat completion"),
            "/v1/models": _get("the served model"),
            "/health": _get("200 when serving; 503 while loading, draining or broken"),
            "/metrics": _get("Prometheus metrics", "text/plain"),
        },
        "components": {"schemas": schemas},
    }
