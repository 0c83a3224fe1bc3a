"""Request migration: a streamed request whose generation server dies goes on on another one.

The router relays whole SSE events only, and learns from a comment line the generation server puts
in each event (`report_tokens`, server/api/generation.py) which tokens that event's text came from;
it takes those lines out (`EventTracker`). So at any moment it knows the exact tokens whose text
the client has. When the generation server's stream breaks (the server died) and the request may
still move (`migration_limit`, another generation server healthy), the request's flow
(server/router/flow.py) runs its legs again from those tokens:
1. a context leg with the prompt's token ids plus those tokens, `prior_output_tokens` = how many of
   them are output (`Migration.context_params`). The context server prefills them all and samples
   the next token; its detokenizer has seen the output so far, so the text it reports for that
   token is exactly what the dead server would have streamed next (an incomplete UTF-8 character
   or a possible stop string held back stays held back), and max_tokens/min_tokens count the
   earlier output;
2. the router streams that text itself under the client's stream id (or, when that token ends the
   request, the final chunk and [DONE]);
3. a generation leg on another generation server with the client's id (`response_id`) and the same
   `prior_output_tokens`, and the relay goes on.
With greedy sampling the client's text equals an undisturbed run. Each move is counted
(pdserve_router_migrations_total). Beyond the limit, or with no other generation server, the stream
ends with an SSE error event, as without migration.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from server.openai.protocol import DisaggParams
from server.router.backends import Backend
from server.router.sse_reader import EventSplitter, split_events

COMMENT = b": tokens"


class EventTracker:
    """Passes whole SSE events on; takes out the token comment lines and records their ids."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens  # appended to as events go by
        self.finished = False  # the server's last output went by
        self._splitter = EventSplitter()

    def feed(self, chunk: bytes) -> bytes:
        """The complete events of what arrived so far (less the comments); a partial event waits."""
        complete = self._splitter.feed(chunk)
        if COMMENT not in complete:
            return complete
        out = []
        for block in split_events(complete):
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

    response_id: str  # the client's stream id
    prompt_ids: list[int]  # the prompt as the context server tokenised it
    tokens: list[int]  # generated so far (their text is with the client)
    limit: int
    moves: int = 0
    dead: set[Backend] = field(default_factory=set)

    def tracker(self) -> EventTracker:
        return EventTracker(self.tokens)

    def possible(self, generation: list[Backend]) -> bool:
        others = [b for b in generation if b.healthy and b not in self.dead]
        return self.moves < self.limit and bool(others)

    def context_params(self) -> DisaggParams:
        """The next context leg's: the prompt and the output so far, the output counted as such."""
        self.moves += 1
        prompt = (*self.prompt_ids, *self.tokens)
        return DisaggParams("context_only", prompt_token_ids=prompt, prior_output_tokens=len(self.tokens))

    def continued(self, params: DisaggParams) -> DisaggParams:
        """The next generation leg's `params` (server/router/flow.py `_handoff`) continue the client's
        stream: its id, the output it has, and the tokens the context leg just sampled."""
        prior = len(self.tokens)
        self.tokens.extend(params.first_gen_tokens or ())
        return replace(params, response_id=self.response_id, report_tokens=True, prior_output_tokens=prior)
