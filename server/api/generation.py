"""Run one request on the engine and answer it as JSON or as an SSE stream; its engine requests
are owned by `RequestStreams`, which aborts the unfinished ones however the exchange ends."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import replace

from starlette.requests import Request
from starlette.responses import Response

from server.api.builder import DEFAULT_MAX_N, Built, build_request, new_request_id
from server.api.deps import check_disagg_access
from server.api.disagg_logprobs import with_context_logprobs
from server.api.streams import RequestStreams, failed, output_error
from server.openai.errors import APIError
from server.openai.formatting import Formatter, continued_response_id
from server.openai.logprobs import aligned
from server.openai.protocol import DISAGG_PARAMS, ChatCompletionRequest, CompletionRequest, DisaggParams
from server.openai.sse import DONE, EventStream, json_event, sse_event, unless_disconnected
from server.openai.wire import dumps
from server.types import EngineClient, GenerateRequest, RequestOutput

CLIENT_CLOSED_STATUS = 499  # nobody reads it: the client is gone
KV_STREAM = "kv_stream"  # a streamed context leg's first event's key


def _merged(outputs: list[RequestOutput]) -> RequestOutput:
    """One choice's outputs as one: all its tokens, text and log-probabilities, the last's counters."""
    entries = [e for o in outputs for e in aligned(o.new_token_ids, o.logprobs)]
    return replace(outputs[-1], new_token_ids=[t for o in outputs for t in o.new_token_ids],
                   new_text="".join(o.new_text for o in outputs),
                   logprobs=entries if any(e is not None for e in entries) else None,
                   prompt_logprobs=next((o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None), None))


async def _collect(streams: RequestStreams) -> list[RequestOutput]:
    """Every choice's outputs merged into one, by index; or [the failure] if one failed."""
    outputs: dict[int, list[RequestOutput]] = defaultdict(list)
    while not streams.finished:
        output = await streams.next()
        if failed(output):
            return [output]
        outputs[output.index].append(output)
    return [_merged(outputs[i]) for i in sorted(outputs)]


def _whole(built: Built, fmt: Formatter, choices: list[RequestOutput]) -> str:
    """The whole answer (`_collect`'s choices); APIError if one failed. A context leg's carries the
    log-probabilities its generation leg cannot compute."""
    if failed(choices[0]):
        raise output_error(choices[0])
    disagg = built.requests[0].disagg
    if disagg is not None and disagg.request_type == "context_only":
        logprobs = built.options.logprobs is not None
        choices = with_context_logprobs(choices, logprobs, logprobs and bool(built.options.echo))
    return fmt.response(choices)


async def respond_json(request: Request, engine: EngineClient, built: Built, fmt: Formatter) -> Response:
    streams = RequestStreams(engine, built.requests, built.transforms)
    try:
        done, choices = await unless_disconnected(lambda: _collect(streams), request.receive)
    finally:
        await streams.close()
    if not done:
        return Response(status_code=CLIENT_CLOSED_STATUS)
    return Response(_whole(built, fmt, choices), media_type="application/json")


async def respond_stream(request: Request, engine: EngineClient, built: Built, fmt: Formatter,
                         report_tokens: bool = False) -> Response:
    """Waits for the first output before answering, so a failure before it still gets its HTTP status."""
    streams = RequestStreams(engine, built.requests, built.transforms)
    try:
        done, first = await unless_disconnected(streams.next, request.receive)
    except BaseException:
        await streams.close()
        raise
    if done and not failed(first):
        return EventStream(engine_events(streams, first, fmt, report_tokens), streams.close)  # closes them at the end
    await streams.close()
    if not done:
        return Response(status_code=CLIENT_CLOSED_STATUS)
    raise output_error(first)


async def respond_context(request: Request, engine: EngineClient, built: Built, fmt: Formatter) -> Response:
    """A context_only request that asked for streamed KV (docs/KV_STREAM.md): plain JSON, or when its KV
    is streamed two SSE events at once: `{"kv_stream": <params>}` (the lease, before the engine admits
    the request), then `{"status", "body"}`: the context answer, or the error with its HTTP status."""
    gen = built.requests[0]
    early = _streamed_params(request, engine, gen)
    if early is None:
        plain = replace(gen, disagg=replace(gen.disagg, kv_stream=False))
        return await respond_json(request, engine, replace(built, requests=[plain]), fmt)
    # closed (aborted if the router left) when the event stream ends
    streams = RequestStreams(engine, built.requests, built.transforms)
    return EventStream(_context_events(streams, built, fmt, early), streams.close)


async def _context_events(streams: RequestStreams, built: Built, fmt: Formatter,
                          early: DisaggParams) -> AsyncIterator[bytes]:
    yield json_event({KV_STREAM: DISAGG_PARAMS.dump_python(early, mode="json")})
    try:
        status, body = 200, _whole(built, fmt, await _collect(streams))
    except APIError as error:
        status, body = error.status, dumps(error.body()).decode()
    yield sse_event(f'{{"status": {status}, "body": {body}}}')
    yield DONE


def _streamed_params(request: Request, engine: EngineClient, gen: GenerateRequest) -> DisaggParams | None:
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


async def engine_events(streams: RequestStreams, first: RequestOutput, fmt: Formatter,
                        report_tokens: bool = False) -> AsyncIterator[bytes]:
    """`data: {json}\n\n` events, an error event if the engine fails mid-stream, then `data: [DONE]`;
    with `report_tokens`, each output's `_token_comment` in the same event as its text."""
    output = first
    while True:
        if failed(output):
            if output.new_text:  # text folded into the failure (`_merged`) still goes out first
                for data in fmt.chunks(replace(output, finished=False, finish_reason=None)):
                    yield sse_event(data)
            yield json_event(output_error(output).body())
            break
        chunks = fmt.chunks(output)
        comment = _token_comment(output, fmt.options.n) if report_tokens else b""
        if comment and not chunks:
            yield comment + b"\n"
        for i, data in enumerate(chunks):
            yield comment + sse_event(data) if i == 0 else sse_event(data)
        if streams.finished:
            if fmt.include_usage:
                yield sse_event(fmt.usage_chunk(output))
            break
        output = await streams.next()
    yield DONE


def _token_comment(output: RequestOutput, n: int) -> bytes:
    """The output's token ids as an SSE comment line (`: tokens 12 34`, `final` on the last; `#1` names
    choice 1 when n > 1): the router takes it out and knows which tokens the text came from (migration)."""
    ids = output.new_token_ids
    if not ids and not output.finished:
        return b""
    final = " final" if output.finished else ""
    choice = f" #{output.index}" if n > 1 else ""
    return f": tokens{choice} {' '.join(map(str, ids))}{final}\n".encode()


async def answer(request: Request, engine: EngineClient, body: CompletionRequest | ChatCompletionRequest,
                 id_prefix: str, formatter: type[Formatter]) -> Response:
    """The whole handling of one completion or chat request: build it, run it, answer JSON or SSE."""
    await check_disagg_access(request, body.disaggregated_params)
    request_id = new_request_id(id_prefix)
    max_n = getattr(request.app.state, "max_n", DEFAULT_MAX_N)
    if body.constrained:  # compiles a grammar: not on the event loop
        built = await asyncio.to_thread(build_request, body, engine, request_id, max_n)
    else:
        built = build_request(body, engine, request_id, max_n)
    disagg = built.requests[0].disagg
    continued = disagg is not None and disagg.first_text_streamed  # the router began the stream
    response_id = (disagg.response_id or continued_response_id(disagg.ctx_request_id)) if continued else request_id
    fmt = formatter(response_id, engine.model_name, include_usage=body.include_usage, continued=continued,
                    options=built.options)
    if disagg is not None and disagg.kv_stream and disagg.request_type == "context_only":
        return await respond_context(request, engine, built, fmt)
    if not body.stream:
        return await respond_json(request, engine, built, fmt)
    return await respond_stream(request, engine, built, fmt, disagg is not None and disagg.report_tokens)
