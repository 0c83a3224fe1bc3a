import torch

from server.engine.request import Request
from server.engine.sampler import sample
from server.types import SamplingParams

EOS = 2


def _request(**params) -> Request:
    return Request("r", [1, 5, 7], SamplingParams(**params), frozenset({EOS}))


def _logits(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


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
        request = _request(temperature=1.5, seed=seed)
        draws.append([sample(logits, [request])[0] for _ in range(20)])
    assert draws[0] == draws[1]
    assert draws[0] != draws[2]


def test_top_k_one_and_tiny_top_p_reduce_to_argmax():
    torch.manual_seed(1)
    logits = torch.randn(1, 100)
    best = int(logits.argmax())
    for params in ({"top_k": 1, "temperature": 1.0, "seed": 3}, {"top_p": 1e-6, "temperature": 1.0, "seed": 3}):
        request = _request(**params)
        assert {sample(logits, [request])[0] for _ in range(10)} == {best}


def test_top_k_restricts_support():
    logits = _logits([[5.0, 4.0, 3.0, -1.0, -2.0]])
    request = _request(top_k=2, temperature=5.0, seed=0)
    assert {sample(logits, [request])[0] for _ in range(200)} == {0, 1}
