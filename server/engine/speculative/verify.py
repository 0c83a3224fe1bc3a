"""Verification of drafted tokens: which drafts a step accepts, and the sampling rows of a verify chunk.

A verify chunk of a request with known tokens t[0..L) and drafts d[0..k) computes the inputs
t[L-1], d[0], ..., d[k-1] at positions L-1 .. L-1+k: its logit row i gives the distribution of
position L+i after t + d[:i]. Each row is sampled exactly as a plain decode step samples (`VerifyRow`
lends it the request's settings, `min_tokens` counting the i tokens before it), giving targets
s[0..k]. The step keeps s[0..a], a = the number of leading i where d[i] == s[i].

Greedy: s[i] is the argmax, so the output is the non-speculative one, token for token. Sampling:
accepting d[i] iff s[i] ~ p_i equals it is the rejection rule for a deterministic drafter (q one-hot
at d[i]): d[i] is accepted with probability p_i(d[i]), and a rejected position's token is a sample of
p_i with d[i] removed and renormalised, so the output distribution is unchanged. A seeded request
draws row i's noise from a key of its output position (sampler.py `noise_seed`): a rejected position
is drawn again with the same key, so its output equals its non-speculative output for that seed.
Row i's penalties count the drafts d[:i] as output (`VerifyRow.drafted`); its log-probabilities are
those of its own logits row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from server.engine.request import Request
from server.types import SamplingParams


def accepted_prefix(drafts: Sequence[int], targets: Sequence[int]) -> int:
    """Leading drafts equal to their targets (len(targets) == len(drafts) + 1)."""
    a = 0
    while a < len(drafts) and drafts[a] == targets[a]:
        a += 1
    return a


@dataclass(frozen=True, eq=False)
class VerifyRow:
    """Row `offset` of a request's verify chunk, as the sampler sees a request (server/engine/sampler.py)."""

    request: Request
    offset: int
    drafted: tuple[int, ...] = ()  # the drafts before this row: output tokens of its position

    @property
    def sampling(self) -> SamplingParams:
        return self.request.sampling

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.request.eos_token_ids

    @property
    def choice(self) -> int:
        return self.request.choice

    @property
    def output_position(self) -> int:
        return self.request.output_position + self.offset

    @property
    def num_output_tokens(self) -> int:
        return self.request.num_output_tokens + self.offset


def sampling_rows(request: Request, drafts: tuple[int, ...]) -> list[Request | VerifyRow]:
    """The sampler rows of one request's chunk: the request itself when it has no drafts."""
    if not drafts:
        return [request]
    return [VerifyRow(request, i, drafts[:i]) for i in range(len(drafts) + 1)]
