"""Request migration: a streamed request whose generation server dies goes on on another one.

The router relays whole SSE events and takes out the comment line in each (`report_tokens`) that
names the tokens its text came from (`EventTracker`), so it knows the exact tokens the client has.
On a broken stream the flow runs a context leg over the prompt plus those tokens
(`prior_output_tokens` of them output), streams that leg's first text itself, and opens a
generation leg elsewhere under the client's id. With greedy sampling the client's text equals an
undisturbed run. Beyond `migration_limit`, the stream ends with an SSE error event."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from server.openai.protocol import DisaggParams
from server.router.backends import Backend
from server.router.kv_stream import EventSplitter, split_events

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

    def possible(self, generation: list[Backend]) -> bool:
        others = [b for b in generation if b.healthy and b not in self.dead]
        return self.moves < self.limit and bool(others)

    def context_params(self) -> DisaggParams:
        """The next context leg's: the prompt and the output so far, the output counted as such."""
        self.moves += 1
        prompt = (*self.prompt_ids, *self.tokens)
        return DisaggParams("context_only", prompt_token_ids=prompt, prior_output_tokens=len(self.tokens))

    def continued(self, params: DisaggParams) -> DisaggParams:
        """The next generation leg's `params`, continuing the client's stream: its id and output so far."""
        prior = len(self.tokens)
        self.tokens.extend(params.first_gen_tokens or ())
        return replace(params, response_id=self.response_id, report_tokens=True, prior_output_tokens=prior)
