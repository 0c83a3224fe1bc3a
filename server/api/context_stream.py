"""The context leg of a request whose KV is streamed while it is prefilled (docs/KV_STREAM.md).

When it streams, the server answers at once with two SSE events: `{"kv_stream": <params>}` (the
lease, before the engine admits the request), then `{"status", "body"}`: the context answer."""

from __future__ import annotations

from starlette.requests import Request

from server.openai.protocol import DISAGG_PARAMS, DisaggParams
from server.openai.sse import json_event, sse_event
from server.types import EngineClient, GenerateRequest

KV_STREAM = "kv_stream"  # the first event's key


def streamed_params(request: Request, engine: EngineClient, gen: GenerateRequest) -> DisaggParams | None:
    """The early answer's parameters when this context_only request's KV is streamed, else None: the
    server's `kv_stream` allows it for this prompt length, it is no moved stream's leg, and its KV
    sender is one rank (a tensor-parallel context server sends whole prompts)."""
    min_tokens = getattr(request.app.state, "kv_stream_min_tokens", None)
    disagg = gen.disagg
    if min_tokens is None or len(gen.prompt_token_ids) < min_tokens or disagg.prior_output_tokens:
        return None
    links = engine.links()
    if links.sender is None or len(links.sender_endpoints) > 1:
        return None
    endpoint, epoch = links.sender
    return DisaggParams("context_only", ctx_request_id=gen.request_id, ctx_endpoint=endpoint, ctx_epoch=epoch,
                        prompt_token_ids=tuple(gen.prompt_token_ids), cache_salt=gen.cache_salt, kv_stream=True)


def early_event(params: DisaggParams) -> bytes:
    return json_event({KV_STREAM: DISAGG_PARAMS.dump_python(params, mode="json")})


def result_event(status: int, body_json: str) -> bytes:
    """The context answer (JSON text) or the error body, with the HTTP status it would have had."""
    return sse_event(f'{{"status": {status}, "body": {body_json}}}')
