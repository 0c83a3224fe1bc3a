"""Log-probabilities across the disaggregation legs, so a generation leg answers what an aggregated
server would: the context server's `first_gen_logprobs` and `prompt_logprobs` go on each choice's
first output; a first token the router streamed itself is left out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from server.openai.logprobs import aligned, floor
from server.openai.protocol import CompactLogprob, DisaggParams
from server.types import RequestOutput, TokenLogprob


def compact(entry: TokenLogprob | None) -> CompactLogprob | None:
    if entry is None:
        return None
    return entry.token_id, floor(entry.logprob), tuple((t, floor(lp)) for t, lp in entry.top)


def expand(entry: CompactLogprob | None) -> TokenLogprob | None:
    if entry is None:
        return None
    token_id, logprob, top = entry
    return TokenLogprob(token_id, logprob, tuple((t, lp) for t, lp in top))


def with_context_logprobs(choices: Sequence[RequestOutput], logprobs: bool, prompt: bool) -> list[RequestOutput]:
    """A context answer's choices, their `disagg` carrying the logprobs only the context server computes."""
    params: dict = {}
    if logprobs:
        params["first_gen_logprobs"] = tuple(compact((c.logprobs or [None])[0]) for c in choices)
    if prompt:
        prompt_entries = next((c.prompt_logprobs for c in choices if c.prompt_logprobs is not None), [])
        params["prompt_logprobs"] = tuple(compact(e) for e in prompt_entries)
    if not params:
        return list(choices)
    return [replace(c, disagg=replace(c.disagg, **params)) if c.disagg is not None else c for c in choices]


class GenerationOutputs:
    """A generation_only request's outputs as an aggregated server would make them: each choice's first
    output gets the context server's logprobs, or loses its token when the router streamed it."""

    def __init__(self, disagg: DisaggParams, n: int) -> None:
        self._disagg = disagg
        self._first_tokens = 1 if n > 1 else len(disagg.first_gen_tokens or ())
        self._seen: set[int] = set()

    def apply(self, output: RequestOutput) -> RequestOutput:
        if output.index in self._seen or not (output.new_token_ids or output.finished):
            return output
        self._seen.add(output.index)
        if self._disagg.first_text_streamed:
            return self._without_first(output)
        firsts = self._disagg.first_gen_logprobs
        changes: dict = {}
        if firsts is not None and output.index < len(firsts) and output.new_token_ids:
            own = aligned(output.new_token_ids, output.logprobs)[1:]
            changes["logprobs"] = [expand(firsts[output.index]), *own]
        if self._disagg.prompt_logprobs is not None and output.prompt_logprobs is None:
            changes["prompt_logprobs"] = [expand(e) for e in self._disagg.prompt_logprobs]
        return replace(output, **changes) if changes else output

    def _without_first(self, output: RequestOutput) -> RequestOutput:
        """The router streamed the text of these tokens (with streamed KV: of the whole first output)."""
        skip = len(output.new_token_ids) if self._disagg.kv_stream else self._first_tokens
        logprobs = aligned(output.new_token_ids, output.logprobs)[skip:] if output.logprobs is not None else None
        return replace(output, new_token_ids=output.new_token_ids[skip:], logprobs=logprobs)
