"""Run one request on the engine and answer it as JSON or as an SSE stream.

Ownership: an `EngineStream` owns the engine's output iterator of one request. Whatever way the
HTTP exchange ends (finished, client gone, error, cancellation), `EngineStream.close()` runs; if the
engine has not finished the request it is aborted there, so its KV blocks are freed. Client
disconnects are watched actively (server/openai/sse.py), so a request that is still queued or
prefilling is aborted too.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import replace

import anyio
from starlette.requests import Request
from starlette.responses import Response

from server.api.access import check_disagg_access
from server.api.context_stream import early_event, result_event, streamed_params
from server.api.errors import output_error
from server.api.prompts import build_request, new_request_id
from server.openai.formatting import Formatter, continued_response_id
from server.openai.protocol import ChatCompletionRequest, CompletionRequest
from server.openai.sse import DONE, EventStream, json_event, sse_event, unless_disconnected
from server.openai.wire import dumps
from server.types import EngineClient, GenerateRequest, RequestOutput

log = logging.getLogger(__name__)

ABORT_TIMEOUT_S = 5.0  # bound on the engine's abort/close when a request ends early
CLIENT_CLOSED_STATUS = 499  # nobody reads it: the client is gone
_FAILED = ("error", "abort")


def failed(output: RequestOutput) -> bool:
    return output.finished and output.finish_reason in _FAILED


class EngineStream:
    """The outputs of one request. `next()` never raises: engine failures become an "error" output."""

    def __init__(self, engine: EngineClient, request: GenerateRequest):
        self._engine = engine
        self._request = request
        self._outputs = None  # created on the first next(): a failing submit is an "error" output too
        self._engine_finished = False  # the engine sent the final output itself

    @property
    def request_id(self) -> str:
        return self._request.request_id

    def _failure(self, message: str) -> RequestOutput:
        return RequestOutput(self.request_id, [], "", finished=True, finish_reason="error",
                             error=message, error_code=500)

    async def next(self) -> RequestOutput:
        try:
            if self._outputs is None:
                self._outputs = self._engine.generate(self._request)
            output = await anext(self._outputs)
        except StopAsyncIteration:
            return self._failure("the engine ended the request without a final output")
        except Exception as exc:
            log.exception("engine failed request %s", self.request_id)
            return self._failure(f"engine error: {type(exc).__name__}: {exc}")
        self._engine_finished = output.finished
        return output

    async def close(self) -> None:
        """Idempotent; aborts the request in the engine unless the engine finished it."""
        outputs, self._outputs = self._outputs, None
        if outputs is None:
            return
        with anyio.move_on_after(ABORT_TIMEOUT_S, shield=True):
            try:
                if not self._engine_finished:
                    await self._engine.abort(self.request_id)
                aclose = getattr(outputs, "aclose", None)
                if aclose is not None:
                    await aclose()
            except Exception:
                log.exception("aborting request %s failed", self.request_id)


async def _collect(stream: EngineStream) -> tuple[str, RequestOutput]:
    texts = []
    while True:
        output = await stream.next()
        texts.append(output.new_text)
        if output.finished:
            return "".join(texts), output


async def respond_json(request: Request, engine: EngineClient, gen: GenerateRequest,
                       fmt: Formatter) -> Response:
    stream = EngineStream(engine, gen)
    try:
        done, result = await unless_disconnected(lambda: _collect(stream), request.receive)
    finally:
        await stream.close()
    if not done:
        return Response(status_code=CLIENT_CLOSED_STATUS)
    text, final = result
    if failed(final):
        raise output_error(final)
    return Response(fmt.response(text, final), media_type="application/json")


async def respond_stream(request: Request, engine: EngineClient, gen: GenerateRequest,
                         fmt: Formatter, tokens: TokenReport | None = None) -> Response:
    """Waits for the first output before answering, so a failure before it still gets its HTTP status."""
    stream = EngineStream(engine, gen)
    try:
        done, first = await unless_disconnected(stream.next, request.receive)
    except BaseException:
        await stream.close()
        raise
    if done and not failed(first):
        return EventStream(engine_events(stream, first, fmt, tokens), stream.close)  # closes it at the end
    await stream.close()
    if not done:
        return Response(status_code=CLIENT_CLOSED_STATUS)
    raise output_error(first)


async def respond_context(request: Request, engine: EngineClient, gen: GenerateRequest, fmt: Formatter) -> Response:
    """A context_only request whose router asked for streamed KV (server/api/context_stream.py): the
    early event and the answer's, or today's JSON when this server does not stream this prompt."""
    early = streamed_params(request, engine, gen)
    if early is None:
        return await respond_json(request, engine, replace(gen, disagg=replace(gen.disagg, kv_stream=False)), fmt)
    stream = EngineStream(engine, gen)
    return EventStream(_context_events(stream, fmt, early_event(early)), stream.close)  # aborts if the router left


async def _context_events(stream: EngineStream, fmt: Formatter, early: bytes) -> AsyncIterator[bytes]:
    yield early
    text, final = await _collect(stream)
    if failed(final):
        error = output_error(final)
        yield result_event(error.status, dumps(error.body()).decode())
    else:
        yield result_event(200, fmt.response(text, final))
    yield DONE


async def engine_events(stream: EngineStream, first: RequestOutput, fmt: Formatter,
                        tokens: TokenReport | None = None) -> AsyncIterator[bytes]:
    """`data: {json}\n\n` events, an error event if the engine fails mid-stream, then `data: [DONE]`.

    With `tokens` (the router asks, `report_tokens`), each output's token ids go in an SSE comment
    line (`: tokens 12 34`, `final` on the last) in the same event as that output's text, so the
    router knows exactly which tokens the text it relayed came from (it moves the stream to another
    server with them if this one dies). Clients ignore comments; the router takes them out."""
    output = first
    while True:
        if failed(output):
            if output.new_text:  # text folded into the failure (`_merged`) still goes out first
                for data in fmt.chunks(replace(output, finished=False, finish_reason=None)):
                    yield sse_event(data)
            yield json_event(output_error(output).body())
            break
        chunks = fmt.chunks(output)
        comment = tokens.comment(output) if tokens is not None else b""
        if comment and not chunks:
            yield comment + b"\n"
        for i, data in enumerate(chunks):
            yield comment + sse_event(data) if i == 0 else sse_event(data)
        if output.finished:
            if fmt.include_usage:
                yield sse_event(fmt.usage_chunk(output))
            break
        output = await stream.next()
    yield DONE


class TokenReport:
    """The token ids of each output as an SSE comment line; ids whose text the router streamed
    itself (`first_text_streamed`: the first tokens; with streamed KV, those of the first output,
    which came with the KV) are not repeated."""

    def __init__(self, skip: int, skip_first_output: bool = False) -> None:
        self._skip = skip
        self._skip_first = skip_first_output

    def comment(self, output: RequestOutput) -> bytes:
        ids = output.new_token_ids
        if self._skip_first:
            ids, self._skip_first = [], False
        if self._skip:
            ids, self._skip = ids[self._skip:], max(0, self._skip - len(ids))
        if not ids and not output.finished:
            return b""
        final = " final" if output.finished else ""
        return f": tokens {' '.join(map(str, ids))}{final}\n".encode()


async def answer(request: Request, engine: EngineClient, body: CompletionRequest | ChatCompletionRequest,
                 id_prefix: str, formatter: type[Formatter]) -> Response:
    """The whole handling of one completion or chat request: build it, run it, answer JSON or SSE."""
    await check_disagg_access(request, body.disaggregated_params)
    request_id = new_request_id(id_prefix)
    gen = build_request(body, engine, request_id)
    disagg = gen.disagg
    continued = disagg is not None and disagg.first_text_streamed  # the router began the stream
    response_id = request_id
    if continued:
        response_id = disagg.response_id or continued_response_id(disagg.ctx_request_id)
    fmt = formatter(response_id, engine.model_name, include_usage=body.include_usage, continued=continued)
    if disagg is not None and disagg.kv_stream and disagg.request_type == "context_only":
        return await respond_context(request, engine, gen, fmt)
    if not body.stream:
        return await respond_json(request, engine, gen, fmt)
    tokens = None
    if disagg is not None and disagg.report_tokens:
        tokens = TokenReport(len(disagg.first_gen_tokens or ()) if continued else 0, continued and disagg.kv_stream)
    return await respond_stream(request, engine, gen, fmt, tokens)
