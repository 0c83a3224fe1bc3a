import torch

from server.engine.penalties import TokenCounts
from server.engine.request import Request
from server.engine.sampler import sample_on_device
from server.types import SamplingParams

EOS = 2


def sample(logits: torch.Tensor, requests: list, counts: TokenCounts | None = None) -> list[int]:
    return sample_on_device(logits, requests, counts).tolist()


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


def test_seeded_noise_depends_on_seed_choice_and_output_position_only():
    """The same (seed, choice, position) draws the same noise wherever the earlier tokens came from:
    a request that starts with 10 output tokens (a generation leg, a moved stream) goes on as the
    one that sampled them; another choice index draws other noise."""
    torch.manual_seed(8)
    logits = torch.randn(1, 64)
    full = _draws(logits, _request(temperature=1.0, seed=7), 30)
    assert _draws(logits, _request(temperature=1.0, seed=7), 30) == full
    later = Request("r", [1, 5, 7], SamplingParams(temperature=1.0, seed=7), frozenset({EOS}),
                    output_token_ids=full[:10])
    assert _draws(logits, later, 20) == full[10:]
    other = Request("r", [1, 5, 7], SamplingParams(temperature=1.0, seed=7), frozenset({EOS}), choice=1)
    assert _draws(logits, other, 30) != full


def test_penalty_counts_follow_the_sampled_ids_on_the_device_and_rows_grow():
    """frequency_penalty 2 between token 3 (logit 5) and 4 (logit 4): 4, then 3, then 4, from counts
    bumped on the device (the tokens are not appended); 20 requests grow the buffer past its first
    rows, and a row given back is clean when taken again."""
    counts = TokenCounts(torch.device("cpu"))
    row = [0.0] * 16
    row[3], row[4] = 5.0, 4.0
    logits = _logits([row] * 20)
    requests = [Request(f"r{i}", [1, 2], SamplingParams(temperature=0.0, frequency_penalty=2.0), frozenset({EOS}),
                        output_token_ids=[3] if i % 2 else []) for i in range(20)]
    draws = [sample(logits, requests, counts) for _ in range(3)]
    assert [d[1] for d in draws] == [4, 3, 4]  # one 3 already in its output
    assert [d[0] for d in draws] == [3, 4, 3]  # none
    assert len(counts) == 20 and counts.counts.shape[0] >= 20
    for request in requests:
        counts.release(request)
    fresh = Request("f", [1, 2], SamplingParams(temperature=0.0, frequency_penalty=2.0), frozenset({EOS}))
    assert sample(logits[:1], [fresh], counts) == [3]


def test_repetition_penalty_covers_the_prompt_and_presence_only_the_output():
    row = [0.0] * 8
    row[3], row[4], row[5] = 5.0, 3.0, -1.0
    logits = _logits([row])
    in_prompt = Request("r", [3, 5], SamplingParams(temperature=0.0, repetition_penalty=2.0), frozenset({EOS}))
    assert sample(logits, [in_prompt]) == [4]  # 5 / 2 < 3
    presence = Request("r", [3, 5], SamplingParams(temperature=0.0, presence_penalty=3.0), frozenset({EOS}))
    assert sample(logits, [presence]) == [3]  # the prompt does not count
    presence.append_token(3)
    assert sample(logits, [presence]) == [4]  # 5 - 3 < 3 once in the output


def test_logit_bias_and_min_p():
    logits = _logits([[2.0, 1.0, 0.0, -1.0]])
    assert sample(logits, [_request(temperature=0.0, logit_bias=((2, 2.5),))]) == [2]
    # p ~ (0.64, 0.24, 0.09, 0.03): min_p 0.3 keeps tokens 0 and 1 only
    request = _request(temperature=1.0, min_p=0.3, seed=1)
    assert set(_draws(logits, request, 300)) == {0, 1}
