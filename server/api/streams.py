"""The engine requests of one HTTP request, and who owns them.

An `EngineStream` owns one engine request's output iterator. Whatever way the exchange ends,
`RequestStreams.close()` closes every one, aborting unfinished ones so their KV blocks are freed.
Choices are numbered as OpenAI orders them: prompt p's choice c is p * n + c."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import replace

import anyio

from server.openai.errors import APIError
from server.types import EngineClient, GenerateRequest, RequestOutput

log = logging.getLogger(__name__)

ABORT_TIMEOUT_S = 5.0  # bound on the engine's abort/close when a request ends early
_FAILED = ("error", "abort")

Transform = Callable[[RequestOutput], RequestOutput]


def failed(output: RequestOutput) -> bool:
    return output.finished and output.finish_reason in _FAILED


def output_error(output: RequestOutput) -> APIError:
    """The error to answer for a final output that ended in "error" or "abort"."""
    if output.finish_reason == "abort":
        return APIError(503, output.error or "the request was aborted by the server", code="aborted")
    status = output.error_code if 400 <= output.error_code < 600 else 500
    return APIError(status, output.error or "the engine failed the request", code="engine_error")


class EngineStream:
    """The outputs of one engine request. `next()` never raises: engine failures become an "error" output."""

    def __init__(self, engine: EngineClient, request: GenerateRequest, transform: Transform | None):
        self._engine = engine
        self._request = request
        self.request_id = request.request_id
        self._transform = transform
        self._outputs = None  # created on the first next(): a failing submit is an "error" output too
        self._open_choices = set(range(request.sampling.n))
        self.finished = False  # every choice finished, or the request failed
        self._engine_done = False  # the engine itself ended the request: nothing to abort

    def _failure(self, message: str) -> RequestOutput:
        return RequestOutput(self.request_id, [], "", finished=True, finish_reason="error",
                             error=message, error_code=500)

    async def next(self) -> RequestOutput:
        try:
            if self._outputs is None:
                self._outputs = self._engine.generate(self._request)
            output = await anext(self._outputs)
        except StopAsyncIteration:
            self.finished = True
            return self._failure("the engine ended the request without a final output of every choice")
        except Exception as exc:
            log.exception("engine failed request %s", self.request_id)
            self.finished = True
            return self._failure(f"engine error: {type(exc).__name__}: {exc}")
        if output.finished:
            self._open_choices.discard(output.index)
            self._engine_done = self._engine_done or failed(output) or not self._open_choices
            self.finished = self._engine_done
        return self._transform(output) if self._transform is not None else output

    async def close(self) -> None:
        """Idempotent; aborts the request in the engine unless the engine finished it."""
        outputs, self._outputs = self._outputs, None
        if outputs is None:
            return
        with anyio.move_on_after(ABORT_TIMEOUT_S, shield=True):
            try:
                if not self._engine_done:
                    await self._engine.abort(self.request_id)
                aclose = getattr(outputs, "aclose", None)
                if aclose is not None:
                    await aclose()
            except Exception:
                log.exception("aborting request %s failed", self.request_id)


class RequestStreams:
    """Every engine request of one HTTP request; `next()` is the next output of any of them."""

    def __init__(self, engine: EngineClient, requests: Sequence[GenerateRequest],
                 transforms: Sequence[Transform | None]):
        self._streams = [EngineStream(engine, r, t) for r, t in zip(requests, transforms, strict=True)]
        self._n = [r.sampling.n for r in requests]
        self._reading: dict[int, asyncio.Future] = {}  # prompt -> its pending next()

    @property
    def finished(self) -> bool:
        """Every engine request ended and every output was taken (a read may hold one not yet taken)."""
        return not self._reading and all(s.finished for s in self._streams)

    async def next(self) -> RequestOutput:
        if len(self._streams) == 1:
            return await self._streams[0].next()
        for p, stream in enumerate(self._streams):
            if not stream.finished and p not in self._reading:
                self._reading[p] = asyncio.ensure_future(stream.next())
        done, _ = await asyncio.wait(self._reading.values(), return_when=asyncio.FIRST_COMPLETED)
        p = min(p for p, task in self._reading.items() if task in done)  # the first prompt's first
        output = self._reading.pop(p).result()
        return replace(output, index=p * self._n[p] + output.index)

    async def close(self) -> None:
        """Idempotent; every engine request not finished is aborted."""
        reading, self._reading = list(self._reading.values()), {}
        for task in reading:
            task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*reading, return_exceptions=True)
            await asyncio.gather(*(s.close() for s in self._streams))
