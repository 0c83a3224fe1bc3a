"""Usage over every choice of an answer, and one choice's outputs merged into one."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from server.openai.logprobs import aligned
from server.openai.responses import PromptTokensDetails, Usage
from server.types import RequestOutput


def merge_outputs(outputs: Sequence[RequestOutput]) -> RequestOutput:
    """One choice's outputs as one: all its tokens, text and log-probabilities, the last's counters."""
    entries = [e for o in outputs for e in aligned(o.new_token_ids, o.logprobs)]
    return replace(outputs[-1], new_token_ids=[t for o in outputs for t in o.new_token_ids],
                   new_text="".join(o.new_text for o in outputs),
                   logprobs=entries if any(e is not None for e in entries) else None,
                   prompt_logprobs=next((o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None), None))


class UsageTally:
    """Usage over every choice: each prompt once (choice index // n), each choice's completion tokens."""

    def __init__(self, n: int = 1) -> None:
        self._n = n
        self._prompts: dict[int, tuple[int, int]] = {}
        self._completions: dict[int, int] = {}

    def observe(self, output: RequestOutput) -> None:
        self._prompts[output.index // self._n] = (output.prompt_tokens, output.cached_tokens)
        self._completions[output.index] = output.completion_tokens

    def usage(self) -> Usage:
        prompt = sum(p for p, _ in self._prompts.values())
        completion = sum(self._completions.values())
        cached = sum(c for _, c in self._prompts.values())
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))
