"""One request's place in its grammar: the tokens it accepted, and the tokens that may come next."""

from __future__ import annotations

from collections import deque

import llguidance
import torch

ERROR_CODE = 500  # a sampled token the grammar refuses is the server's failure, not the client's


class RequestGrammar:
    """Feeds a request's output tokens to its llguidance matcher (`accept`, from `Request.append_token`)
    and fills its row of a step's token bitmask (`fill`). Once nothing but EOS may follow, the request
    ends ("stop") with the token that completed it."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher
        self.error: str | None = None  # set when a token was refused: the matcher accepts nothing more
        self.ahead: deque[int] = deque()  # tokens fed before their step was postprocessed (`feed_ahead`)

    def accept(self, token: int) -> bool:
        """Feed the request's next output token (one `feed_ahead` took already is not fed twice)."""
        if self.ahead:
            fed = self.ahead.popleft()
            if fed != token:
                raise RuntimeError(f"grammar fed token {fed} ahead, but the output's token is {token}")
            return self.error is None
        return self._consume(token)

    def feed_ahead(self, token: int) -> None:
        """Feed a sampled token whose step is not postprocessed yet, so the next mask can be filled."""
        self.ahead.append(token)
        self._consume(token)

    def _consume(self, token: int) -> bool:
        if self.error is None and not self.matcher.consume_token(token):
            self.error = f"token {token} does not match the output's grammar"
        return self.error is None

    @property
    def open(self) -> bool:
        """Neither ended nor left: its mask says what may come next."""
        return self.error is None and not self.matcher.is_stopped()

    def ending(self) -> tuple | None:
        """`Request.finish` arguments once the grammar ends the request, else None."""
        if self.error is not None:
            return "error", self.error, ERROR_CODE
        return ("stop",) if self.matcher.is_stopped() else None

    def fill(self, row: torch.Tensor) -> None:
        """Write the allowed next tokens into `row` (int32 on the CPU, contiguous, one bit per id)."""
        self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())

    def fork(self) -> RequestGrammar:
        """An independent copy at the same place (a choice forked from another, n > 1)."""
        copy = RequestGrammar(self.matcher.deep_copy())
        copy.error, copy.ahead = self.error, deque(self.ahead)
        return copy
