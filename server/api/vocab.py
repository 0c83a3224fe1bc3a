"""Token ids a request carries (prompt, stop_token_ids, the disaggregation legs' ids) must be ids of
the model's vocabulary (`EngineClient.vocab_size`, which may exceed the tokenizer's)."""

from __future__ import annotations

from collections.abc import Sequence

from server.api.errors import APIError


def check_in_vocab(ids: Sequence[int], vocab_size: int, param: str) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} in {param} is outside the vocabulary [0, {vocab_size})", param=param)


def token_ids(ids: Sequence[int], vocab_size: int, param: str) -> list[int]:
    """A non-empty list of the vocabulary's ids (a prompt)."""
    if not ids:
        raise APIError(400, f"{param} must not be empty", param=param)
    check_in_vocab(ids, vocab_size, param)
    return list(ids)
