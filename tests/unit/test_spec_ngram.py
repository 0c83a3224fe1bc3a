"""Speculative decoding without a model: the n-gram drafter's proposals and the acceptance rules
(greedy prefix, and the rejection rule's statistics on a toy distribution)."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
import torch

from server.engine.request import Request
from server.engine.sampler import sample_on_device
from server.engine.scheduler import SchedulerConfig
from server.engine.speculative.config import SpeculativeConfig
from server.engine.speculative.decoder import SpecDecoder
from server.engine.speculative.ngram import NgramDrafter, NgramIndex
from server.engine.speculative.verify import VerifyRow, accepted_prefix, sampling_rows
from server.types import SamplingParams


def _propose(tokens: list[int], k: int = 4, lo: int = 1, hi: int = 3) -> list[int]:
    return NgramIndex(lo, hi).propose(tokens, k)


def test_longest_suffix_wins_and_its_most_recent_occurrence():
    #        0  1  2  3  4  5  6  7  8  9 10 11 12
    tokens = [5, 6, 7, 1, 2, 9, 6, 7, 3, 4, 8, 6, 7]
    # suffix (6, 7) occurs at 1 and 6: the most recent (6) is followed by 3, 4, 8, 6
    assert _propose(tokens, hi=2) == [3, 4, 8, 6]
    # suffix (8, 6, 7) never occurred earlier; (6, 7) did: the longest that occurred wins
    assert _propose(tokens, hi=3) == [3, 4, 8, 6]
    assert _propose([1, 2, 3, 1, 2, 3, 1, 2], k=3, lo=3, hi=3) == [3, 1, 2]  # (3, 1, 2) at 2 -> overlap
    assert _propose([1, 2, 3, 1, 2, 3, 1, 2], k=3, lo=2, hi=3) == [3, 1, 2]  # (1, 2) most recent at 3
    assert _propose(tokens + [7], lo=2) == []  # (7, 7) never occurred, 1-grams are not tried
    assert _propose(tokens + [7], lo=1) == [7]  # 7 last occurred at 12, followed by the 7 at 13
    assert _propose([4, 4], k=5) == [4]  # only as many as followed the occurrence
    assert _propose([1, 2, 3], k=4) == []
    assert _propose([1, 2, 1], k=0) == []


def test_a_longer_gram_beats_a_more_recent_shorter_one():
    tokens = [1, 2, 3, 50, 9, 3, 60, 1, 2, 3]
    assert _propose(tokens, lo=1, hi=3) == [50, 9, 3, 60]  # (1, 2, 3) at 0, though 3 alone last led to 60
    assert _propose(tokens, lo=1, hi=1) == [60, 1, 2, 3]


def propose_ngram(tokens: Sequence[int], k: int, ngram_min: int, ngram_max: int) -> list[int]:
    """One lookup without an index: the reference `NgramIndex` is tested against."""
    for n in range(ngram_max, ngram_min - 1, -1):
        if len(tokens) <= n:
            continue
        suffix = list(tokens[-n:])
        for start in range(len(tokens) - n - 1, -1, -1):
            if list(tokens[start:start + n]) == suffix:
                return list(tokens[start + n:start + n + k])
    return []


def test_index_grown_token_by_token_equals_the_reference_lookup():
    rng = random.Random(0)
    for trial in range(20):
        index, tokens = NgramIndex(1, 4), []
        vocab = 3 + trial % 6  # small vocabularies repeat often
        for _ in range(80):
            tokens.append(rng.randrange(vocab))
            if rng.random() < 0.7:  # some steps look up, some only grow (a paused request)
                assert index.propose(tokens, 5) == propose_ngram(tokens, 5, 1, 4)


def test_drafter_keeps_one_index_per_request_and_drops_it_with_the_request():
    drafter = NgramDrafter(1, 2)
    a = Request("a", [1, 2, 3, 1, 2], SamplingParams(), frozenset())
    b = Request("b", [7, 8, 7], SamplingParams(), frozenset())
    assert drafter.propose([a, b], [2, 3]) == [[3, 1], [8, 7]]
    a.append_token(3)
    assert drafter.propose([a], [4]) == [[1, 2, 3]]
    del a
    assert len(drafter._indexes) == 1


def test_greedy_acceptance_is_the_matching_prefix_plus_one():
    assert accepted_prefix([4, 5, 6], [4, 5, 9, 1]) == 2
    spec = SpecDecoder(SpeculativeConfig(method="ngram"), SchedulerConfig(), NgramDrafter(1, 3))
    request = Request("r", [1], SamplingParams(max_tokens=64), frozenset())
    assert spec.accept(request, (4, 5, 6), [4, 5, 9, 1]) == [4, 5, 9]
    assert spec.accept(request, (4, 5, 6), [4, 5, 6, 1]) == [4, 5, 6, 1]  # all accepted: the bonus token too
    assert spec.accept(request, (4, 5, 6), [3, 5, 6, 1]) == [3]
    assert (spec.stats.proposed, spec.stats.accepted, spec.stats.emitted, spec.stats.verified) == (9, 5, 8, 3)


def test_verify_rows_count_earlier_rows_toward_min_tokens():
    eos = 2
    request = Request("r", [1], SamplingParams(temperature=0.0, min_tokens=2, max_tokens=8), frozenset({eos}))
    rows = sampling_rows(request, (7, 8, 9))
    assert [r.num_output_tokens for r in rows] == [0, 1, 2, 3]
    logits = torch.zeros(4, 5)
    logits[:, eos] = 10.0  # EOS is everyone's favourite, but the first two rows may not emit it
    assert sample_on_device(logits, rows).tolist() == [0, 0, eos, eos]
    assert sampling_rows(request, ()) == [request]


def test_rejection_rule_keeps_the_distribution_and_accepts_with_p_of_the_draft():
    """Sampling each row and accepting the draft iff it is the sample: the first emitted token is
    distributed as p, the draft is accepted with probability p(draft), and a rejected position's
    token follows p without the draft, renormalised."""
    torch.manual_seed(0)
    p = torch.tensor([0.05, 0.15, 0.3, 0.1, 0.4])
    draft, n = 2, 20000
    request = Request("r", [1], SamplingParams(temperature=1.0, max_tokens=8), frozenset())
    logits = p.log().repeat(2 * n, 1)  # n verify chunks of one draft: rows (draft position, bonus)
    picked = sample_on_device(logits, [VerifyRow(request, i % 2) for i in range(2 * n)]).view(n, 2).tolist()
    runs = [targets[:accepted_prefix([draft], targets) + 1] for targets in picked]
    first = torch.bincount(torch.tensor([r[0] for r in runs]), minlength=5) / n
    assert torch.allclose(first, p, atol=0.015)
    accepted = sum(len(r) == 2 for r in runs) / n
    assert accepted == pytest.approx(p[draft].item(), abs=0.015)
    rejected = torch.tensor([r[0] for r in runs if len(r) == 1])
    without = p.clone()
    without[draft] = 0
    assert torch.allclose(torch.bincount(rejected, minlength=5) / len(rejected), without / without.sum(), atol=0.015)
    bonus = torch.tensor([r[1] for r in runs if len(r) == 2])  # after an accepted draft: p again
    assert torch.allclose(torch.bincount(bonus, minlength=5) / len(bonus), p, atol=0.02)


def test_config_rejects_inconsistent_settings():
    assert SpeculativeConfig().method == "off"  # speculation is off by default
    with pytest.raises(ValueError, match="ngram_min"):
        SpeculativeConfig(method="ngram", ngram_min=4, ngram_max=2)
    with pytest.raises(ValueError, match="draft_model: required"):
        SpeculativeConfig(method="draft_model")
    with pytest.raises(ValueError, match="draft_model: only read"):
        SpeculativeConfig(method="ngram", draft_model="builtin:tiny-llama")
