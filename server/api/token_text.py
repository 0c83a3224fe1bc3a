"""Each token's text and bytes, for log-probabilities.

The text is the token decoded alone. The bytes are the token's own: byte-level BPE's vocabulary
string mapped back through the byte alphabet, SentencePiece's `▁` and `<0xAB>` fallbacks, else UTF-8."""

from __future__ import annotations

import functools
import json
import re

from server.openai.logprobs import Piece

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
SPIECE_SPACE = "\u2581"
CACHE_SIZE = 1 << 16


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


@functools.lru_cache(maxsize=4)
def pieces_for(tokenizer) -> TokenPieces:
    return TokenPieces(tokenizer)
