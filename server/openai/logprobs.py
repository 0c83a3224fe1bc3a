"""Engine log-probabilities (`TokenLogprob`: token ids) -> OpenAI's JSON shapes (docs/API.md,
"Log-probability shapes"). A token's string is the token decoded alone, its `bytes` its own bytes
(part of a character when the tokenizer split one): byte-level BPE's vocabulary string mapped back
through the byte alphabet, SentencePiece's `▁` and `<0xAB>` fallbacks, else UTF-8 (`TokenPieces`).
"""

from __future__ import annotations

import codecs
import functools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

from server.openai.responses import CompletionLogprobs, TokenLogprobOut, TopLogprob
from server.types import TokenLogprob

LOGPROB_FLOOR = -9999.0  # JSON has no -inf (vLLM sends the same floor)
_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
SPIECE_SPACE = "\u2581"
CACHE_SIZE = 1 << 16


@dataclass(frozen=True)
class Piece:
    text: str  # the token decoded alone
    data: bytes  # its bytes
    special: bool = False  # a special token: no text in the answer


@functools.cache
def byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character standing for each byte, reversed."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _is_byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    return any(p.get("type") == "ByteLevel" for p in parts)


class TokenPieces:
    """`piece(token_id)` for one tokenizer; build once per engine (`pieces_for`)."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self._special = frozenset(tokenizer.all_special_ids) | {i for i, t in added.items() if t.special}
        self._bytes = byte_alphabet() if _is_byte_level(tokenizer) else None
        self.piece = functools.lru_cache(maxsize=CACHE_SIZE)(self._piece)

    def _piece(self, token_id: int) -> Piece:
        vocab_string = self._tokenizer.convert_ids_to_tokens(token_id)
        if vocab_string is None:  # an id beyond the tokenizer (a padded vocabulary)
            return Piece("", b"", special=True)
        text = self._tokenizer.decode([token_id], skip_special_tokens=False)
        if token_id in self._special:
            return Piece(text, text.encode(), special=True)
        return Piece(text, self._raw_bytes(vocab_string, text))

    def _raw_bytes(self, vocab_string: str, text: str) -> bytes:
        if self._bytes is not None and all(c in self._bytes for c in vocab_string):
            return bytes(self._bytes[c] for c in vocab_string)
        byte = _BYTE_TOKEN.match(vocab_string)
        if byte is not None:
            return bytes([int(byte.group(1), 16)])
        if SPIECE_SPACE in vocab_string:
            return vocab_string.replace(SPIECE_SPACE, " ").encode()
        return text.encode()


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
                            entries: Sequence[TokenLogprob | None], pieces: TokenPieces, offsets: TextOffsets) -> None:
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


def chat_logprobs(token_ids: Sequence[int], entries: Sequence[TokenLogprob | None], pieces: TokenPieces,
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


@functools.lru_cache(maxsize=4)
def pieces_for(tokenizer) -> TokenPieces:
    return TokenPieces(tokenizer)
