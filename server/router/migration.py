"""Request migration: a streamed request whose generation server dies goes on on another one.

The router relays whole SSE events only, and learns from a comment line the generation server puts
in each event (`report_tokens`, server/api/generation.py) which tokens that event's text came from;
it takes those lines out (`EventTracker`). So at any moment it knows the exact tokens whose text
the client has. When the generation server's stream breaks (the server died) and the request may
still move (`migration_limit`, another generation server healthy), `Migration.move`:
1. sends the prompt's token ids plus those tokens to a context server as `context_only` with
   `prior_output_tokens` = how many of them are output. The context server prefills them all and
   samples the next token; its detokenizer has seen the output so far, so the text it reports for
   that token is exactly what the dead server would have streamed next (an incomplete UTF-8
   character or a possible stop string held back stays held back), and max_tokens/min_tokens
   count the earlier output;
2. streams that text itself under the client's stream id (or, when that token ends the request,
   the final chunk and [DONE]);
3. sends the generation leg to another generation server with the client's id (`response_id`) and
   the same `prior_output_tokens`, and the relay goes on.
With greedy sampling the client's text equals an undisturbed run. Each move is counted
(pdserve_router_migrations_total). Beyond the limit, or with no other generation server, the stream
ends with an SSE error event, as without migration.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace

from server.openai.formatting import continued_response_id
from server.openai.protocol import DisaggParams
from server.router.backends import Backend
from server.router.context_events import closing_events, generation_params, opening_events
from server.router.orchestrator import Orchestrator, Upstream, context_finished, context_params

COMMENT = b": tokens"


class EventTracker:
    """Passes whole SSE events on; takes out the token comment lines and records their ids."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens  # appended to as events go by
        self.finished = False  # the server's last output went by
        self._buffer = b""

    def feed(self, chunk: bytes) -> bytes:
        """The complete events of what arrived so far (less the comments); a partial event waits."""
        buffer = self._buffer + chunk
        end = buffer.rfind(b"\n\n")
        if end < 0:
            self._buffer = buffer
            return b""
        complete, self._buffer = buffer[: end + 2], buffer[end + 2 :]
        if COMMENT not in complete:
            return complete
        out = []
        for block in complete[:-2].split(b"\n\n"):
            while block.startswith(COMMENT):
                line, _, block = block.partition(b"\n")
                self._record(line)
            if block:
                out.append(block + b"\n\n")
        return b"".join(out)

    def _record(self, line: bytes) -> None:
        words = line[len(COMMENT):].split()
        if words and words[-1] == b"final":
            self.finished = True
            words = words[:-1]
        self.tokens.extend(int(w) for w in words)


@dataclass
class Migration:
    """One streamed request's state for moving it: what it asked, what was generated so far."""

    orchestrator: Orchestrator
    path: str
    body: dict  # the client's request
    chat: bool
    response_id: str  # the client's stream id
    prompt_ids: list[int]  # the prompt as the context server tokenised it
    tokens: list[int]  # generated so far (their text is with the client)
    limit: int
    on_move: Callable[[], None] = lambda: None
    moves: int = 0
    dead: set[Backend] = field(default_factory=set)

    def tracker(self) -> EventTracker:
        return EventTracker(self.tokens)

    def possible(self) -> bool:
        others = [b for b in self.orchestrator.generation if b.healthy and b not in self.dead]
        return self.moves < self.limit and bool(others)

    async def move(self) -> tuple[list[bytes], Upstream | None, DisaggParams | None]:
        """(the events the router sends itself, the context leg's answer, the parameters of the
        generation leg that goes on from it); answer None: that context leg ended the request.
        A failing context leg raises `LegError`."""
        self.moves += 1
        self.on_move()
        prior = len(self.tokens)
        prompt = [*self.prompt_ids, *self.tokens]
        ctx = await self.orchestrator.context_leg(self.path, self.body, lambda: prompt, DisaggParams(
            "context_only", prompt_token_ids=tuple(prompt), prior_output_tokens=prior))
        if context_finished(ctx.json):
            include_usage = bool((self.body.get("stream_options") or {}).get("include_usage"))
            return closing_events(ctx.json, self.chat, self.response_id, include_usage, continued=True), None, None
        params = replace(generation_params(ctx.json, first_text_streamed=True), response_id=self.response_id,
                         report_tokens=True, prior_output_tokens=prior)
        self.tokens.extend(params.first_gen_tokens or ())
        return opening_events(ctx.json, self.chat, self.response_id, continued=True), ctx, params

    def generation_leg(self, params: DisaggParams) -> Callable[[], Awaitable[Upstream]]:
        prompt = params.prompt_token_ids
        return lambda: self.orchestrator.generation_leg(self.path, self.body, lambda: prompt, params,
                                                        exclude=frozenset(self.dead))


def new_migration(orchestrator: Orchestrator, ctx: dict, path: str, body: dict, chat: bool) -> Migration | None:
    """The migration state of a stream the router opened from context answer `ctx` (None when
    migration is off: `router.migration_limit: 0`)."""
    if orchestrator.migration_limit <= 0:
        return None
    params = context_params(ctx)
    return Migration(orchestrator, path, body, chat, continued_response_id(params.ctx_request_id),
                     list(params.prompt_token_ids or ()),
                     list(params.first_gen_tokens or ()), orchestrator.migration_limit,
                     orchestrator.on_migration)
