"""Both legs at once, for a context leg that answered early (streamed KV, server/router/kv_stream.py).

The generation leg starts as soon as the context server has said where the lease will be; its pull
waits for the prefill and takes the blocks as they are written, and the first token comes to the
generation server with the last of them. Meanwhile the router waits for the context answer, and
from there on the request goes as before: a context answer that ends the request is returned and the
generation leg closed; a streamed request gets the first token's events from the context answer,
then the generation leg's stream (`ContextFirstStream`, with migration); a JSON one the generation
leg's answer. Every way out (client gone, either leg failing) closes the other leg: a generation
server aborts its request and cancels its pull, a context server aborts its request, and both
release the lease's blocks.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

from server.openai.sse import EventStream
from server.openai.wire import JSONBody
from server.router.context_events import opening_events
from server.router.kv_stream import EarlyContext
from server.router.migration import new_migration
from server.router.orchestrator import Orchestrator, Upstream, context_finished
from server.router.streaming import ContextFirstStream, context_first_response


async def close_leg(task: asyncio.Future) -> None:
    """Stop a generation leg however far it got (its server aborts the request)."""
    task.cancel()
    opened = (await asyncio.gather(task, return_exceptions=True))[0]
    if isinstance(opened, Upstream) and opened.stream is not None:
        await opened.stream.aclose()


class EarlyLegs:
    """One request's two legs, the generation one started from the context leg's early answer."""

    def __init__(self, orchestrator: Orchestrator, ctx: EarlyContext, path: str, body: dict, prompt) -> None:
        self.orchestrator, self.ctx, self.path, self.body = orchestrator, ctx, path, body
        stream = bool(body.get("stream"))
        self.params = replace(ctx.params, request_type="generation_only", first_text_streamed=stream,
                              report_tokens=stream and orchestrator.migration_limit > 0)
        self.generation = asyncio.ensure_future(orchestrator.generation_leg(path, body, prompt, self.params))

    async def context_answer(self) -> dict:
        """The context answer; if it fails (or the wait is cancelled) the generation leg is closed."""
        try:
            return await self.ctx.rest()
        except BaseException:
            await asyncio.shield(self.close())
            raise

    async def close(self) -> None:
        await self.ctx.close()
        await close_leg(self.generation)

    async def release(self) -> None:
        """The generation leg never pulled: free the context server's lease now."""
        await self.orchestrator.release_context(self.ctx.backend, self.params)

    async def respond(self, answer: dict, chat: bool, final_answer) -> EventStream | JSONBody:
        """After the context answer: its own final answer, or the first token and the generation leg."""
        if context_finished(answer):
            await close_leg(self.generation)
            return final_answer(answer, self.body, chat)
        if self.body.get("stream"):
            migration = new_migration(self.orchestrator, answer, self.path, self.body, chat)
            return context_first_response(ContextFirstStream(
                opening_events(answer, chat), lambda: self.generation, self.release, migration))
        try:
            upstream = await self.generation
        except BaseException:  # it failed, or the client left: nothing will pull the lease
            await asyncio.shield(self._abandon())
            raise
        return JSONBody(upstream.json)

    async def _abandon(self) -> None:
        await close_leg(self.generation)
        await self.release()
