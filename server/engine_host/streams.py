"""A request's outputs between the engine loop and the coroutine that streams them (event loop side).

A `ChoiceStream` takes a request's outputs in order (`put`) and hands them out folded (`take`); the
request is `done` once every choice's final output has been handed out."""

from __future__ import annotations

import asyncio

from server.types import RequestOutput


class ChoiceStream:
    def __init__(self, request_id: str, n: int) -> None:
        self.request_id = request_id
        self._queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._unsent = set(range(n))  # choices whose final output has not been put
        self._open = n  # choices whose final output has not been taken

    @property
    def done(self) -> bool:
        return self._open == 0

    def put(self, output: RequestOutput) -> None:
        if output.finished:
            self._unsent.discard(output.index)
        self._queue.put_nowait(output)

    def fail(self, message: str, code: int = 503) -> None:
        """End every choice whose final output has not come with an error (the engine is gone)."""
        for index in sorted(self._unsent):
            self.put(RequestOutput(self.request_id, [], "", finished=True, finish_reason="error", error=message,
                                   error_code=code, index=index))

    async def take(self) -> list[RequestOutput]:
        """The next output, and what queued up behind it, folded (`merged`); waits for one."""
        outputs = [await self._queue.get()]
        while not self._queue.empty():
            outputs.append(self._queue.get_nowait())
        outputs = merged(outputs)
        self._open -= sum(o.finished for o in outputs)
        return outputs


def merged(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """Fold each choice's queued outputs into one, up to its final output (fewer, larger SSE events
    when HTTP lags behind the engine); choices keep the order of their first output."""
    out: list[RequestOutput] = []
    open_at: dict[int, int] = {}  # choice -> where its unfinished fold is in `out`
    for later in outputs:
        at = open_at.pop(later.index, None)
        if at is None:
            at = len(out)
            out.append(later)
        else:
            out[at] = _fold(out[at], later)
        if not out[at].finished:
            open_at[later.index] = at
    return out


def _fold(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    later.new_token_ids = earlier.new_token_ids + later.new_token_ids
    later.new_text = earlier.new_text + later.new_text
    later.disagg = later.disagg or earlier.disagg
    if earlier.logprobs is not None or later.logprobs is not None:
        later.logprobs = (earlier.logprobs or []) + (later.logprobs or [])
    if later.prompt_logprobs is None:
        later.prompt_logprobs = earlier.prompt_logprobs
    return later
