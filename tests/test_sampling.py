"""sampling.py: draws keyed by (seed, token index), exact against hand-computed filters and a reference hash."""
import math

import pytest
import torch

from ppo_affine.sampling import draw_keys, filter_scores, mix64, row_keys, sample_tokens, uniform_noise

MASK = (1 << 64) - 1


def keys(seeds, counters) -> torch.Tensor:
    return draw_keys(list(seeds), list(counters), vocab=6, device=torch.device("cpu"))


def reference_mix64(x: int) -> int:
    """splitmix64's finaliser on unsigned 64-bit Python ints."""
    x &= MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def test_the_tensor_hash_is_splitmix64_with_wrapping_int64_arithmetic():
    values = [0, 1, 12345, (1 << 63) - 1, -1, -(1 << 63)]
    got = mix64(torch.tensor(values, dtype=torch.long)).tolist()
    assert [g & MASK for g in got] == [reference_mix64(v) for v in values]


def test_row_keys_hash_on_the_host_as_the_tensor_hash_does():
    seeds, counters = [0, 7, 4_000_000_000], [0, 3, 12]
    expected = [reference_mix64(s * 0x9E3779B97F4A7C15 + c) for s, c in zip(seeds, counters)]
    assert [k & MASK for k in row_keys(seeds, counters)] == expected


def test_noise_depends_only_on_the_rows_seed_and_counter():
    alone = uniform_noise(torch.tensor(row_keys([7], [3])), 50)
    batched = uniform_noise(torch.tensor(row_keys([1, 7, 7], [3, 3, 4])), 50)
    assert torch.equal(alone[0], batched[1])
    assert not torch.equal(batched[0], batched[1]) and not torch.equal(batched[1], batched[2])
    assert 0.0 < float(batched.min()) and float(batched.max()) < 1.0


def test_top_k_and_top_p_keep_the_hand_computed_tokens():
    scores = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    assert torch.isinf(filter_scores(scores, top_k=2, top_p=1.0)).tolist() == [[False, False, True, True, True]]
    # mass before each token: 0, .5, .7, .85, .95; top_p = 0.7 keeps the tokens whose better ones hold < 0.7
    assert torch.isinf(filter_scores(scores, top_k=0, top_p=0.7)).tolist() == [[False, False, True, True, True]]
    assert torch.isinf(filter_scores(scores, top_k=0, top_p=0.71)).tolist() == [[False, False, False, True, True]]
    shuffled = scores[:, [3, 0, 4, 2, 1]]  # the filter follows the scores, not the ids
    assert torch.isinf(filter_scores(shuffled, 0, 0.7)).tolist() == [[True, False, True, True, False]]


def test_greedy_is_argmax_and_samples_follow_the_tempered_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]])
    assert sample_tokens(logits, keys([0], [0]), temperature=0.0)[0].tolist() == [2]
    draws = 20_000
    tokens, _ = sample_tokens(logits.expand(draws, 4), keys(range(draws), [0] * draws), temperature=2.0)
    expected = torch.softmax(logits[0] / 2.0, dim=0)
    counts = torch.bincount(tokens, minlength=4).double() / draws
    for p, q in zip(counts.tolist(), expected.tolist()):
        assert abs(p - q) < 4 * math.sqrt(q * (1 - q) / draws)  # within 4 standard errors


def test_temperature_top_k_and_top_p_together_sample_the_hand_computed_distribution():
    """Temperature first, then the filters on the tempered probabilities. logits / 0.5 = [6, 4.8, 4, 2, 1, 0];
    top-k 4 leaves [6, 4.8, 4, 2], whose softmax is [.6874, .2070, .0930, .0126]: the mass before the 4th token is
    .9874 >= top-p .95, so it goes. Left: softmax([6, 4.8, 4]) = [.696122, .209668, .094210]. (Top-p applied to the
    untempered logits would keep the 4th token, mass before .934, and draw it ~1.3 % of the time.)"""
    logits = torch.tensor([[3.0, 2.4, 2.0, 1.0, 0.5, 0.0]])
    draws = 20_000
    tokens, _ = sample_tokens(logits.expand(draws, 6), keys(range(draws), [5] * draws), temperature=0.5, top_k=4,
                              top_p=0.95)
    counts = torch.bincount(tokens, minlength=6).tolist()
    assert counts[3:] == [0, 0, 0]
    expected = [0.696122 * draws, 0.209668 * draws, 0.094210 * draws]
    chi_square = sum((seen - e) ** 2 / e for seen, e in zip(counts[:3], expected))
    assert chi_square < 13.82  # 2 degrees of freedom, p = 0.001


def test_each_token_comes_with_its_log_prob_under_the_distribution_it_was_drawn_from():
    """The same filters as above: after them the kept tokens' probabilities are [.696122, .209668, .094210]; greedy
    reports the untempered log-prob (log softmax([3, 2.4, 2, 1, .5, 0])[0] = log .457897), as the trainer scores it."""
    logits = torch.tensor([[3.0, 2.4, 2.0, 1.0, 0.5, 0.0]]).expand(3, 6)
    tokens, logprobs = sample_tokens(logits, keys([1, 2, 3], [0, 0, 0]), temperature=0.5, top_k=4, top_p=0.95)
    kept = {0: 0.696122, 1: 0.209668, 2: 0.094210}
    assert logprobs.dtype == torch.float64
    for token, logprob in zip(tokens.tolist(), logprobs.tolist()):
        assert logprob == pytest.approx(math.log(kept[token]), abs=1e-5)  # the probabilities to 6 digits
    greedy, greedy_logprob = sample_tokens(logits[:1], keys([0], [0]), temperature=0.0)
    assert greedy.tolist() == [0] and greedy_logprob.item() == pytest.approx(math.log(0.457897), abs=1e-6)
