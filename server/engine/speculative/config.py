"""`SpeculativeConfig`: the `speculative:` section of a server's YAML. A msgspec Struct like
`KvCacheConfig`: the deployment loader (server/config/schema.py) checks types, ranges and unknown keys
when it converts the YAML, and `__post_init__` what spans two fields, so every error names the key
and the file. No torch here: the router reads deployments without loading a model."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

Method = Literal["off", "ngram", "draft_model"]


class SpeculativeConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Default off. `ngram`: prompt lookup (the tokens that followed the longest recent suffix of
    prompt + output that occurred earlier); `draft_model`: a small model of the same tokenizer."""

    method: Method = "off"
    num_speculative_tokens: Annotated[int, msgspec.Meta(ge=1, le=16)] = 4  # k drafts per step
    ngram_min: Annotated[int, msgspec.Meta(ge=1, le=16)] = 1  # shortest suffix looked up
    ngram_max: Annotated[int, msgspec.Meta(ge=1, le=16)] = 3  # longest suffix looked up (tried first)
    draft_model: str | None = None  # method draft_model: builtin:NAME or a model directory
    # speculate only in steps that decode at most this many requests (a large batch is compute-bound:
    # verifying k more tokens per request costs about as much as they save)
    max_decode_batch: Annotated[int, msgspec.Meta(ge=1)] = 8

    def __post_init__(self) -> None:
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min: {self.ngram_min} is above ngram_max ({self.ngram_max})")
        if self.method == "draft_model" and not self.draft_model:
            raise ValueError("draft_model: required when method is draft_model (builtin:NAME or a model directory)")
        if self.method != "draft_model" and self.draft_model:
            raise ValueError(f"draft_model: only read when method is draft_model (method is {self.method})")
