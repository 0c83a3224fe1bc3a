"""Engine log-probabilities (`TokenLogprob`: token ids) -> OpenAI's JSON shapes (docs/API.md,
"Log-probability shapes"). A token's string is the token decoded alone, its `bytes` its own bytes
(part of a character when the tokenizer split one: server/api/token_text.py).
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from server.openai.responses import CompletionLogprobs, TokenLogprobOut, TopLogprob
from server.types import TokenLogprob

LOGPROB_FLOOR = -9999.0  # JSON has no -inf (vLLM sends the same floor)


@dataclass(frozen=True)
class Piece:
    text: str  # the token decoded alone
    data: bytes  # its bytes
    special: bool = False  # a special token: no text in the answer


class Pieces(Protocol):
    def piece(self, token_id: int) -> Piece: ...


def floor(logprob: float) -> float:
    return logprob if logprob >= LOGPROB_FLOOR else LOGPROB_FLOOR  # NaN and -inf too (NaN >= x is False)


class TextOffsets:
    """Characters of a choice's text so far, token by token."""

    def __init__(self, start: int = 0) -> None:
        self.chars = start
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def advance(self, piece: Piece) -> int:
        at = self.chars
        if not piece.special:
            self.chars += len(self._utf8.decode(piece.data))
        return at

    def resync(self, chars: int) -> None:
        """After an echoed prompt: the generated text starts right after the prompt's text."""
        self.chars = chars
        self._utf8.reset()


def add_completion_logprobs(out: CompletionLogprobs, token_ids: Sequence[int],
                            entries: Sequence[TokenLogprob | None], pieces: Pieces, offsets: TextOffsets) -> None:
    for token_id, entry in zip(token_ids, entries, strict=True):
        piece = pieces.piece(token_id)
        out.tokens.append(piece.text)
        out.text_offset.append(offsets.advance(piece))
        if entry is None:  # an echoed prompt's first token: nothing before it to predict it from
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(floor(entry.logprob))
        top = {pieces.piece(t).text: floor(lp) for t, lp in entry.top}
        top.setdefault(piece.text, floor(entry.logprob))
        out.top_logprobs.append(top)


def chat_logprobs(token_ids: Sequence[int], entries: Sequence[TokenLogprob | None], pieces: Pieces,
                  top_n: int) -> list[TokenLogprobOut]:
    out = []
    for token_id, entry in zip(token_ids, entries, strict=True):
        if entry is None:
            continue
        piece = pieces.piece(token_id)
        top = [_top(pieces.piece(t), lp) for t, lp in entry.top[:top_n]]
        out.append(TokenLogprobOut(token=piece.text, logprob=floor(entry.logprob), bytes=list(piece.data),
                                   top_logprobs=top))
    return out


def _top(piece: Piece, logprob: float) -> TopLogprob:
    return TopLogprob(token=piece.text, logprob=floor(logprob), bytes=list(piece.data))


def aligned(token_ids: Sequence[int], entries: Sequence[TokenLogprob] | None) -> list[TokenLogprob | None]:
    """One entry per token: an engine output's `logprobs`, or None where it has none (a token the
    engine did not sample, e.g. a generation leg's first token without the context server's entry)."""
    entries = list(entries or ())
    missing = len(token_ids) - len(entries)
    return [None] * missing + entries if missing > 0 else entries[len(entries) - len(token_ids):]

