"""The context leg of a request whose KV is streamed while it is prefilled.

The router asks for it (`disaggregated_params.kv_stream` on a context_only request); this server
decides (`kv_stream` in its config: `kv_stream_min_tokens`, set in server/deploy/serve.py). When it
streams, it answers at once, before the engine has even admitted the request, with an SSE stream
of two events: first `{"kv_stream": <disaggregated_params>}` (the lease's id, this server's KV
endpoint and epoch, the prompt's token ids), from which the router starts the generation leg, whose
pull then waits for the lease and takes each block as the prefill writes it; then `{"status": 200,
"body": <the context answer>}` once the first token is sampled (or the error's status and body),
then `[DONE]`. When it does not stream, the answer is today's JSON. The engine side is
server/engine/kv_connector.py (`ContextConnector.progress`) and transceiver/sender/stream.py;
server/api/generation.py `respond_context` sends the events.
"""

from __future__ import annotations

from pydantic import TypeAdapter
from starlette.requests import Request

from server.openai.protocol import DisaggParams
from server.openai.sse import json_event, sse_event
from server.types import EngineClient, GenerateRequest

KV_STREAM = "kv_stream"  # the first event's key
_PARAMS = TypeAdapter(DisaggParams)


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
    return json_event({KV_STREAM: _PARAMS.dump_python(params, mode="json")})


def result_event(status: int, body_json: str) -> bytes:
    """The context answer (JSON text) or the error body, with the HTTP status it would have had."""
    return sse_event(f'{{"status": {status}, "body": {body_json}}}')
