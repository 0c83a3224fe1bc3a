"""Per-request state inside the engine (unified token accounting: no prefill and decode phases).

A step computes `num_tokens - num_computed_tokens` tokens (prompt + generated, less those whose K/V
are cached; capped by the token budget), and once the counts meet the last logits are sampled. A
request that arrives with its KV (a generation leg) starts with `num_computed_tokens == len(prompt)`.

With async scheduling a sampled token reaches the host one step late: until then it is *pending*
(`num_pending`), counted in `num_tokens` (its next row's input is taken from the device) but not in
`all_token_ids`. When the scheduler runs, a request has at most one pending token, and only if every
known token is computed.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from server.types import DEFAULT_RETENTION_PRIORITY, DisaggParams, FinishReason, SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from server.engine.structured.matcher import RequestGrammar


class Status(enum.Enum):
    WAITING = "waiting"  # not admitted (no blocks)
    WAITING_FOR_KV = "transferring"  # generation side: blocks allocated, KV being pulled
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    eos_token_ids: frozenset[int]
    arrival_time: float = field(default_factory=time.monotonic)
    disagg: DisaggParams | None = None
    cache_salt: str | None = None  # prefix-cache namespace (KVCacheManager.admit's salt)
    kv_retention_priority: int = DEFAULT_RETENTION_PRIORITY  # eviction priority of its blocks
    choice: int = 0  # which of the request's `n` choices this is (its seeded noise is keyed by it)
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_pending: int = 0  # sampled on the device, id not yet on the host (async scheduling)
    num_cached_tokens: int = 0  # prefix-cache hit reported to the client (first admission only)
    admitted_once: bool = False
    kv_received: bool = False  # generation side: the context server's KV has been pulled
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None
    error_code: int = 500
    # log-probabilities (server/engine/logprobs.py): those of accepted tokens not yet in an output,
    # and the prompt's (entry 0 None), filled as its prefill chunks are computed
    logprob_queue: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs_missing: int = 0  # prompt positions whose logprobs are still to compute
    scheduled_time: float | None = None  # first admission (end of the queue time)
    first_token_time: float | None = None
    last_token_time: float | None = None
    parent: Request | None = field(default=None, repr=False)  # a forked choice's request (choice 0)
    children: list[Request] = field(default_factory=list, repr=False)  # choice 0: choices 1..n-1, in order
    grammar: RequestGrammar | None = None  # structured output: fed every output token (server/engine/structured/)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)
        if self.sampling.prompt_logprobs is not None and not self.is_generation_only:  # the context leg's
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)
            self.prompt_logprobs_missing = max(0, len(self.prompt_token_ids) - 1)

    @property
    def num_tokens(self) -> int:
        """Prompt and generated tokens, the pending one included (the scheduler's count)."""
        return len(self.all_token_ids) + self.num_pending

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids are on the host (what stop rules and prefix-cache commits see)."""
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens, the pending ones included (what min_tokens counts when sampling)."""
        return len(self.output_token_ids) + self.num_pending

    @property
    def num_prior_output(self) -> int:
        """Output a moved stream had before this leg: the last tokens of its prompt."""
        return self.disagg.prior_output_tokens if self.disagg is not None else 0

    @property
    def output_position(self) -> int:
        """The output position of the token its next sampled row makes (0: the first token of the
        request, wherever it is computed): a moved stream's prior output and a pending token count."""
        return self.num_prior_output + self.num_output_tokens

    def counted_output(self) -> list[int]:
        """The known tokens that frequency and presence penalties count as output: a moved stream's
        prior output, then what it has (a generation leg: the context server's first token(s))."""
        return self.prompt_token_ids[len(self.prompt_token_ids) - self.num_prior_output:] + self.output_token_ids

    @property
    def max_cached_tokens(self) -> int | None:
        """The cap of its prefix-cache hit at admission: 0 while its prompt logprobs are still to
        compute (a position reused from the cache has no logits), else None (the KV manager's default)."""
        return 0 if self.prompt_logprobs_missing else None

    def last_token_pending(self, max_seq_len: int) -> bool:
        """Its pending token is certainly its last (a context leg's one token, max_tokens, max_seq_len),
        so a further row could produce nothing."""
        if not self.num_pending:
            return False
        return (self.is_context_only or self.num_output_tokens >= self.sampling.max_tokens
                or self.num_tokens >= max_seq_len)

    @property
    def output_id(self) -> str:
        """The id its outputs go out under: every choice's is the request's own."""
        return self.request_id if self.parent is None else self.parent.request_id

    @property
    def forks_pending(self) -> bool:
        """Its other choices are still to be forked (n > 1, before its first token)."""
        return self.sampling.n > 1 and self.parent is None and not self.children

    @property
    def batch_slots(self) -> int:
        """Rows of a step it will take: all its choices' until they are forked."""
        return self.sampling.n if self.forks_pending else 1

    @property
    def first_tokens_with_kv(self) -> bool:
        """Generation side: its first tokens are taken when the KV has arrived (a streamed pull brings
        them; with n > 1 the other choices fork then, each taking its own), not before the pull."""
        return self.disagg.kv_stream or self.sampling.n > 1

    def choice_first_tokens(self) -> tuple[int, ...]:
        """Context side, choice 0: the first token of each choice, in choice order."""
        return tuple(r.output_token_ids[0] for r in (self, *self.children))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_context_only(self) -> bool:
        return self.disagg is not None and self.disagg.request_type == "context_only"

    @property
    def is_generation_only(self) -> bool:
        return self.disagg is not None and self.disagg.request_type == "generation_only"

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept(token_id)

    def take_first_tokens(self, tokens: tuple[int, ...], ctx_cached_tokens: int) -> None:
        """Generation side: the context server's first token of each choice (`tokens[i]` is choice
        i's) is known, from a streamed pull or from the request once its KV arrived; take its own."""
        self.append_token(tokens[self.choice])
        self.disagg = replace(self.disagg, first_gen_tokens=tuple(tokens), ctx_cached_tokens=ctx_cached_tokens)

    def finish(self, reason: FinishReason, error: str | None = None, code: int = 500) -> None:
        self.status = Status.FINISHED
        self.finish_reason = reason
        self.error = error
        self.error_code = code
