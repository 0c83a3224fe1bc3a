import torch

from server.engine.request import Request
from server.engine.sampler import sample
from server.types import SamplingParams

EOS = 2


def _request(**params) -> Request:
    return Request("r", [1, 5, 7], SamplingParams(**params), frozenset({EOS}))


def _logits(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def _draws(logits: torch.Tensor, request: Request, n: int) -> list[int]:
    """n tokens of one row, each appended as the engine does (a seeded row's noise is keyed by its
    output position, so the position must move between draws)."""
    out = []
    for _ in range(n):
        out.append(sample(logits, [request])[0])
        request.append_token(out[-1])
    return out


def test_greedy_takes_argmax_first_index_on_ties():
    logits = _logits([[0.0, 3.0, 3.0, 1.0], [5.0, 0.0, 0.0, 0.0]])
    assert sample(logits, [_request(temperature=0.0), _request(temperature=0.0)]) == [1, 0]


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = _logits([[0.0, 1.0, 9.0, 8.0, 2.0]])
    request = _request(temperature=0.0, min_tokens=2, stop_token_ids=(3,))
    assert sample(logits, [request]) == [4]
    request.append_token(4)
    request.append_token(4)
    assert sample(logits, [request]) == [2]


def test_same_seed_same_tokens_and_different_seed_differs():
    torch.manual_seed(0)
    logits = torch.randn(1, 64)
    draws = []
    for seed in (11, 11, 12):
        draws.append(_draws(logits, _request(temperature=1.5, seed=seed), 20))
    assert draws[0] == draws[1]
    assert draws[0] != draws[2]


def test_top_k_one_and_tiny_top_p_reduce_to_argmax():
    torch.manual_seed(1)
    logits = torch.randn(1, 100)
    best = int(logits.argmax())
    for params in ({"top_k": 1, "temperature": 1.0, "seed": 3}, {"top_p": 1e-6, "temperature": 1.0, "seed": 3}):
        assert set(_draws(logits, _request(**params), 10)) == {best}


def test_top_k_restricts_support():
    logits = _logits([[5.0, 4.0, 3.0, -1.0, -2.0]])
    assert set(_draws(logits, _request(top_k=2, temperature=5.0, seed=0), 200)) == {0, 1}


def test_batched_draws_follow_the_softmax_of_the_tempered_scores():
    """The exponential race over a batch: 8000 rows of one distribution in one call."""
    torch.manual_seed(5)
    row = [2.0, 1.0, 0.0, -1.0, 1.5]
    requests = [_request(temperature=0.7) for _ in range(8000)]
    tokens = torch.tensor(sample(_logits([row] * len(requests)), requests))
    freq = torch.bincount(tokens, minlength=len(row)).float() / len(requests)
    torch.testing.assert_close(freq, torch.softmax(torch.tensor(row) / 0.7, 0), atol=0.015, rtol=0)


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    torch.manual_seed(6)
    row = [3.0, 2.9, 0.0, -5.0]  # p ~ (0.51, 0.47, 0.02, 0.0): top_p 0.6 keeps the first two
    requests = [_request(temperature=1.0, top_p=0.6) for _ in range(4000)]
    assert set(sample(_logits([row] * len(requests)), requests)) == {0, 1}


def test_seeded_rows_do_not_depend_on_the_rest_of_the_batch():
    torch.manual_seed(7)
    logits = torch.randn(3, 50)
    alone = sample(logits[1:2], [_request(temperature=1.0, seed=99)])
    mixed = sample(logits, [_request(temperature=0.0), _request(temperature=1.0, seed=99), _request(temperature=2.0)])
    assert mixed[1] == alone[0]
    assert mixed[0] == int(logits[0].argmax())
