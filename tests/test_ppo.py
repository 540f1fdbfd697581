"""ppo.py against numbers computed by hand (the derivations are in the comments)."""
import math

import pytest
import torch

from ppo_affine.ppo import (
    AdaptiveKLController,
    FixedKLController,
    compute_gae,
    entropy_from_logits,
    explained_variance,
    explained_variance_moments,
    group_advantages,
    kl_penalty,
    logprobs_and_entropy_from_logits,
    logprobs_from_hidden,
    logprobs_from_logits,
    masked_mean,
    masked_var,
    masked_whiten,
    policy_loss,
    softmax_advantage_gradient,
    softmax_advantage_score,
    truncated_importance_weights,
    value_loss,
)


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float64),
                               torch.as_tensor(expected, dtype=torch.float64), atol=atol, rtol=0)


# ---------------------------------------------------------------- log-probs and entropy
def test_logprobs_match_hand_softmax():
    # log p(label) = z_label - logsumexp(z)
    # [1, 2, 3], label 2: 3 - (3 + log(1 + e^-1 + e^-2)) = -0.4076060
    # [0, 0, 0], label 0: log(1/3) = -1.0986123
    # [2, 0, -1], label 1: 0 - (2 + log(1 + e^-2 + e^-3)) = -2.1698460
    logits = torch.tensor([[[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]], [[2.0, 0.0, -1.0], [0.0, 0.0, 0.0]]])
    labels = torch.tensor([[2, 0], [1, 0]])
    close(logprobs_from_logits(logits, labels), [[-0.4076060, -1.0986123], [-2.1698460, -1.0986123]])


def test_logprobs_stable_for_large_logits():
    # a naive softmax overflows at e^1000; log-softmax gives 0 and -1000
    logits = torch.tensor([[[1000.0, 0.0], [1000.0, 0.0]]])
    close(logprobs_from_logits(logits, torch.tensor([[0, 1]])), [[0.0, -1000.0]])


def test_logprobs_are_fp32_for_bf16_logits():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0]]], dtype=torch.bfloat16)
    logprobs = logprobs_from_logits(logits, torch.tensor([[3]]))
    assert logprobs.dtype == torch.float32
    close(logprobs, [[-1.3862944]])  # log(1/4)


def test_logprobs_chunking_matches_values_and_gradients():
    # d log p(label) / d z = onehot(label) - softmax(z); for z = [0, 0, 0], label 0: [2/3, -1/3, -1/3]
    zeros = torch.zeros(1, 3, 3)
    for chunk_size in (1, 2, None):
        logits = zeros.clone().requires_grad_(True)
        logprobs = logprobs_from_logits(logits, torch.tensor([[0, 1, 2]]), chunk_size=chunk_size)
        logprobs[0, 0].backward()
        close(logprobs.detach(), [[-1.0986123] * 3])
        close(logits.grad, [[[2 / 3, -1 / 3, -1 / 3], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]])


def test_entropy_is_masked_mean_over_tokens():
    # softmax([1, 2, 3]) = [0.0900306, 0.2447285, 0.6652410], H = -sum p log p = 0.8323956
    # uniform over 3: H = log 3 = 1.0986123; the padded third token is ignored
    # mean = (0.8323956 + 1.0986123) / 2 = 0.9655039
    logits = torch.tensor([[[1.0, 2.0, 3.0], [0.0, 0.0, 0.0], [100.0, 0.0, 0.0]]])
    mask = torch.tensor([[1, 1, 0]])
    close(entropy_from_logits(logits, mask), 0.9655039)
    close(entropy_from_logits(logits, mask, chunk_size=1), 0.9655039)


def test_entropy_gradient_through_chunks():
    # H(z) = log Z - sum p z; at uniform z the gradient of H is 0 in every direction
    logits = torch.zeros(1, 2, 4, requires_grad=True)
    entropy_from_logits(logits, torch.ones(1, 2), chunk_size=1).backward()
    close(logits.grad, torch.zeros(1, 2, 4))


def _head(weight):
    head = torch.nn.Linear(len(weight[0]), len(weight), bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.tensor(weight))
    return head.requires_grad_(False)


def test_logprobs_from_hidden_match_hand_softmax_per_chunk():
    # head rows e1, e2, e1 + e2: hidden [1, 2] -> logits [1, 2, 3], hidden [0, 0] -> [0, 0, 0], [2, -3] -> [2, -3, -1]
    # label 2 of [1, 2, 3]: -0.4076060, H = 0.8323956; label 0 of [0, 0, 0]: log(1/3), H = log 3
    # label 1 of [2, -3, -1]: -3 - (2 + log(1 + e^-5 + e^-3)) = -5.0549852
    #   p = [0.9464991, 0.0063775, 0.0471234], H = -sum p log p = 0.2282428
    head = _head([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    hidden = torch.tensor([[1.0, 2.0], [0.0, 0.0], [2.0, -3.0]])
    labels = torch.tensor([2, 0, 1])
    for chunk_size in (1, 2, None):
        logprobs, entropy = logprobs_from_hidden(hidden, head, labels, with_entropy=True, chunk_size=chunk_size)
        close(logprobs, [-0.4076060, -1.0986123, -5.0549852])
        close(entropy, [0.8323956, 1.0986123, 0.2282428])
    assert logprobs_from_hidden(hidden, head, labels)[1] is None  # no entropy unless asked


def test_logprobs_from_hidden_divide_by_the_temperature():
    # hidden [2, 4] at temperature 2 -> logits [1, 2, 3]: label 2 gives -0.4076060 as above
    head = _head([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    logprobs, _ = logprobs_from_hidden(torch.tensor([[1.0, 2.0]]) * 2, head, torch.tensor([2]), temperature=2.0,
                                       chunk_size=1)
    close(logprobs, [-0.4076060])


def test_logprobs_from_hidden_gradients_flow_through_recomputed_chunks():
    # d log p(label) / d h = W^T (onehot(label) - softmax(W h)); at h = 0 softmax is uniform over 3:
    # label 0: W^T [2/3, -1/3, -1/3] = [2/3 - 1/3, -1/3 - 1/3] = [1/3, -2/3]
    head = _head([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    for chunk_size in (1, None):
        hidden = torch.zeros(2, 2, requires_grad=True)
        logprobs, _ = logprobs_from_hidden(hidden, head, torch.tensor([0, 2]), chunk_size=chunk_size)
        logprobs[0].backward()
        close(hidden.grad, [[1 / 3, -2 / 3], [0.0, 0.0]])


def test_logprobs_from_hidden_equal_the_full_logits_path_in_float32():
    # what scoring did before the head ran per chunk: the whole [N, V] logits, then log-softmax per chunk of rows
    generator = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(16, 1000, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(1000, 16, generator=generator) * 0.25)  # log-probs near log(1/1000)
    hidden = torch.randn(50, 16, generator=generator, requires_grad=True)
    labels = torch.randint(0, 1000, (50,), generator=generator)
    full_logprobs, full_entropy = logprobs_and_entropy_from_logits((head(hidden) / 0.7).unsqueeze(0),
                                                                   labels.unsqueeze(0))
    (full_logprobs.sum() + full_entropy.sum()).backward()
    expected_grads = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad = head.weight.grad = None
    logprobs, entropy = logprobs_from_hidden(hidden, head, labels, temperature=0.7, with_entropy=True, chunk_size=7)
    (logprobs.sum() + entropy.sum()).backward()
    close(logprobs, full_logprobs[0])
    close(entropy, full_entropy[0])
    close(hidden.grad, expected_grads[0])
    close(head.weight.grad, expected_grads[1])


def test_logprobs_from_hidden_of_no_rows_is_empty():
    logprobs, entropy = logprobs_from_hidden(torch.zeros(0, 2), _head([[1.0, 0.0]]), torch.zeros(0, dtype=torch.long),
                                             with_entropy=True)
    assert logprobs.shape == entropy.shape == (0,)


# ---------------------------------------------------------------- masked statistics
def test_masked_mean_ignores_padding_even_nan():
    x = torch.tensor([[1.0, 2.0, float("nan")], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    close(masked_mean(x, mask), 1.5)
    close(masked_mean(x, mask, dim=1), [1.5, 0.0])  # an empty row gives 0, not NaN


def test_masked_mean_of_empty_mask_is_zero():
    close(masked_mean(torch.tensor([3.0, 4.0]), torch.tensor([0, 0])), 0.0)


def test_masked_var_unbiased_and_biased():
    # valid [1, 2, 3, 4]: mean 2.5, squared deviations sum to 5 -> 5/3 unbiased, 5/4 biased
    x = torch.tensor([1.0, 2.0, 3.0, 4.0, 99.0])
    mask = torch.tensor([1, 1, 1, 1, 0])
    close(masked_var(x, mask), 5 / 3)
    close(masked_var(x, mask, unbiased=False), 1.25)


def test_masked_var_of_one_element_is_zero():
    close(masked_var(torch.tensor([7.0, 1.0]), torch.tensor([1, 0])), 0.0)


def test_masked_whiten_zero_mean_unit_variance_padding_zero():
    # (x - 2.5) / sqrt(5/3) = [-1.1618950, -0.3872983, 0.3872983, 1.1618950]
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 99.0, 99.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    whitened = masked_whiten(x, mask)
    close(whitened, [[-1.1618950, -0.3872983, 0.3872983], [1.1618950, 0.0, 0.0]])
    close(masked_mean(whitened, mask), 0.0)
    close(masked_var(whitened, mask), 1.0)


def test_masked_whiten_without_shift_keeps_mean():
    # the whitened values + 2.5: [1.3381050, 2.1127017, 2.8872983, 3.6618950]; padding still 0
    x = torch.tensor([1.0, 2.0, 3.0, 4.0, 99.0])
    mask = torch.tensor([1, 1, 1, 1, 0])
    close(masked_whiten(x, mask, shift_mean=False), [1.3381050, 2.1127017, 2.8872983, 3.6618950, 0.0])


def test_masked_whiten_empty_mask_is_all_zero():
    close(masked_whiten(torch.tensor([1.0, 2.0]), torch.tensor([0, 0])), [0.0, 0.0])


# ---------------------------------------------------------------- GAE
def test_gae_right_padding_does_not_leak():
    # gamma 0.9, lam 0.8 (gamma*lam = 0.72)
    # row 1, r [0, 0, 1], V [0.5, 0.6, 0.7]:
    #   delta = [0.9*0.6-0.5, 0.9*0.7-0.6, 1-0.7] = [0.04, 0.03, 0.3]
    #   A2 = 0.3, A1 = 0.03 + 0.72*0.3 = 0.246, A0 = 0.04 + 0.72*0.246 = 0.21712
    # row 2, r [0, 2, pad], V [0.4, 0.3, pad 9.0]: the value after the last valid token is 0, not 9
    #   delta1 = 2 + 0 - 0.3 = 1.7, delta0 = 0.9*0.3 - 0.4 = -0.13
    #   A1 = 1.7, A0 = -0.13 + 0.72*1.7 = 1.094
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    values = torch.tensor([[0.5, 0.6, 0.7], [0.4, 0.3, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    advantages, returns = compute_gae(rewards, values, mask, gamma=0.9, lam=0.8)
    close(advantages, [[0.21712, 0.246, 0.3], [1.094, 1.7, 0.0]])
    close(returns, [[0.71712, 0.846, 1.0], [1.494, 2.0, 0.0]])


# a two-turn episode: turn 1 = tokens 0-1 ending in an illegal-move penalty, turn 2 = tokens 2-4
# ending in the final score
TURNS_REWARDS = [0.0, -0.1, 0.0, 0.0, 1.0]
TURNS_VALUES = [0.2, 0.3, 0.4, 0.5, 0.6]


def test_gae_across_turn_boundary_gamma_1_lam_095():
    # delta = [0.3-0.2, -0.1+0.4-0.3, 0.5-0.4, 0.6-0.5, 1-0.6] = [0.1, 0.0, 0.1, 0.1, 0.4]
    # A4 = 0.4, A3 = 0.1 + 0.95*0.4 = 0.48, A2 = 0.1 + 0.95*0.48 = 0.556,
    # A1 = 0 + 0.95*0.556 = 0.5282, A0 = 0.1 + 0.95*0.5282 = 0.60179
    advantages, returns = compute_gae(torch.tensor([TURNS_REWARDS]), torch.tensor([TURNS_VALUES]),
                                      torch.ones(1, 5), gamma=1.0, lam=0.95)
    close(advantages, [[0.60179, 0.5282, 0.556, 0.48, 0.4]])
    close(returns, [[0.80179, 0.8282, 0.956, 0.98, 1.0]])


def test_gae_across_turn_boundary_gamma_09_lam_05():
    # delta = [0.9*0.3-0.2, -0.1+0.9*0.4-0.3, 0.9*0.5-0.4, 0.9*0.6-0.5, 1-0.6]
    #       = [0.07, -0.04, 0.05, 0.04, 0.4];  gamma*lam = 0.45
    # A4 = 0.4, A3 = 0.04 + 0.45*0.4 = 0.22, A2 = 0.05 + 0.45*0.22 = 0.149,
    # A1 = -0.04 + 0.45*0.149 = 0.02705, A0 = 0.07 + 0.45*0.02705 = 0.0821725
    advantages, returns = compute_gae(torch.tensor([TURNS_REWARDS]), torch.tensor([TURNS_VALUES]),
                                      torch.ones(1, 5), gamma=0.9, lam=0.5)
    close(advantages, [[0.0821725, 0.02705, 0.149, 0.22, 0.4]])
    close(returns, [[0.2821725, 0.32705, 0.549, 0.72, 1.0]])


def test_gae_gamma_lam_1_returns_are_reward_to_go():
    # Monte Carlo: return_t = sum of rewards from t on = [0.9, 0.9, 1, 1, 1]
    _, returns = compute_gae(torch.tensor([TURNS_REWARDS]), torch.tensor([TURNS_VALUES]),
                             torch.ones(1, 5), gamma=1.0, lam=1.0)
    close(returns, [[0.9, 0.9, 1.0, 1.0, 1.0]])


def test_gae_skips_masked_gap_between_turns():
    # the same episode with two unmasked prompt tokens (junk values) between the turns
    # gives the gamma 0.9 / lam 0.5 numbers above on the generated tokens, 0 on the gap
    rewards = torch.tensor([[0.0, -0.1, 0.0, 0.0, 0.0, 0.0, 1.0]])
    values = torch.tensor([[0.2, 0.3, 5.0, 5.0, 0.4, 0.5, 0.6]])
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 1]])
    advantages, returns = compute_gae(rewards, values, mask, gamma=0.9, lam=0.5)
    close(advantages, [[0.0821725, 0.02705, 0.0, 0.0, 0.149, 0.22, 0.4]])
    close(returns, [[0.2821725, 0.32705, 0.0, 0.0, 0.549, 0.72, 1.0]])


def test_gae_rejects_reward_on_masked_position():
    with pytest.raises(ValueError, match="masked position"):
        compute_gae(torch.tensor([[0.0, 1.0]]), torch.zeros(1, 2), torch.tensor([[1, 0]]), 1.0, 1.0)


def test_gae_returns_carry_no_gradient():
    values = torch.tensor([[0.5, 0.5]], requires_grad=True)
    advantages, returns = compute_gae(torch.tensor([[0.0, 1.0]]), values, torch.ones(1, 2), 1.0, 1.0)
    assert not advantages.requires_grad and not returns.requires_grad


# ---------------------------------------------------------------- group advantages
def test_group_advantages_singleton_and_zero_variance_groups():
    # group 7: [1, 0, 0.5], mean 0.5, sample std sqrt((0.25+0.25+0)/2) = 0.5
    #   -> [0.5, -0.5, 0] / (0.5 + 1e-6) = [0.999998, -0.999998, 0]
    # group 3: one episode -> 0;  group 11: [0.3, 0.3, 0.3] -> 0
    # group 5: [2, 4], mean 3, std sqrt(2) -> [-1, 1] / (1.4142136 + 1e-6) = [-0.7071063, 0.7071063]
    returns = torch.tensor([1.0, 0.7, 0.0, 0.3, 0.5, 0.3, 2.0, 0.3, 4.0])
    group_ids = [7, 3, 7, 11, 7, 11, 5, 11, 5]
    close(group_advantages(returns, group_ids),
          [0.999998, 0.0, -0.999998, 0.0, 0.0, 0.0, -0.7071063, 0.0, 0.7071063])


def test_group_advantages_zero_variance_is_exactly_zero():
    # 0.1 + 0.1 + 0.1 rounds away from 0.3, so mean-subtraction alone would leave ~1e-17 / 1e-6
    advantages = group_advantages(torch.tensor([0.1, 0.1, 0.1], dtype=torch.float64), torch.tensor([0, 0, 0]))
    assert advantages.tolist() == [0.0, 0.0, 0.0]


def test_group_advantages_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="same length"):
        group_advantages(torch.tensor([1.0, 2.0]), [0])


# ---------------------------------------------------------------- policy loss
def test_policy_loss_clipping_both_signs_values_and_gradients():
    # cliprange 0.2, old logprobs 0, so ratio = exp(logp)
    # t0: A=+1, ratio 1.5: -1.5 vs clipped -1.2 -> clipped (-1.2), gradient 0
    # t1: A=-1, ratio 0.5:  0.5 vs clipped  0.8 -> clipped ( 0.8), gradient 0
    # t2: A=+1, ratio 0.6: -0.6 vs clipped -0.8 -> unclipped (-0.6), d/dlogp = -A*ratio/4 = -0.15
    # t3: A=-1, ratio 1.5:  1.5 vs clipped  1.2 -> unclipped ( 1.5), d/dlogp = -A*ratio/4 = 0.375
    # t4: padding (ratio e^3, A=5) -> ignored
    # loss = (-1.2 + 0.8 - 0.6 + 1.5) / 4 = 0.125
    logprobs = torch.log(torch.tensor([[1.5, 0.5, 0.6, 1.5, math.e**3]])).requires_grad_(True)
    advantages = torch.tensor([[1.0, -1.0, 1.0, -1.0, 5.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    loss, stats = policy_loss(logprobs, torch.zeros(1, 5), advantages, mask, cliprange=0.2)
    loss.backward()
    close(loss.detach(), 0.125)
    close(logprobs.grad, [[0.0, 0.0, -0.15, 0.375, 0.0]])
    close(stats["clipfrac"], 0.5)


def test_policy_loss_kl_and_ratio_stats():
    # ratios [1.5, 0.5, 0.6, 1.5]
    # k1 = mean(-log r) = -(0.4054651 - 0.6931472 - 0.5108256 + 0.4054651) / 4 = 0.0982606
    # k3 = mean((r - 1) - log r) = mean(r - 1) + k1 = 0.025 + 0.0982606 = 0.1232606
    logprobs = torch.log(torch.tensor([[1.5, 0.5, 0.6, 1.5, math.e**3]]))
    _, stats = policy_loss(logprobs, torch.zeros(1, 5), torch.ones(1, 5), torch.tensor([[1, 1, 1, 1, 0]]), 0.2)
    assert all(isinstance(value, float) for value in stats.values())
    close(stats["approx_kl_k1"], 0.0982606)
    close(stats["approx_kl_k3"], 0.1232606)
    close(stats["ratio_mean"], 1.025)
    close(stats["ratio_max"], 1.5)


def test_policy_loss_clamps_log_ratio_before_exp():
    # log-ratio 50 is clamped to 20: ratio e^20 = 485165195.41, loss -A*ratio stays finite
    loss, stats = policy_loss(torch.tensor([[50.0]]), torch.zeros(1, 1), torch.tensor([[-1.0]]), torch.ones(1, 1), 0.2)
    assert math.isfinite(loss.item())
    close(stats["ratio_max"], 485165195.41, atol=100.0)


def test_policy_loss_weighted_mean_and_micro_batch_normaliser():
    # the four per-token terms of the clipping test: [-1.2, 0.8, -0.6, 1.5], weights [0.5, 0.5, 0.25, 0.25]
    # sum w*l = -0.6 + 0.4 - 0.15 + 0.375 = 0.025; / sum w (1.5) = 0.0166667; / total_weight 2 = 0.0125
    # gradients (unclipped tokens only): t2 -A*ratio*w/W = -0.6*0.25/1.5 = -0.1, t3 = 1.5*0.25/1.5 = 0.25
    logprobs = torch.log(torch.tensor([[1.5, 0.5, 0.6, 1.5, math.e**3]])).requires_grad_(True)
    advantages = torch.tensor([[1.0, -1.0, 1.0, -1.0, 5.0]])
    weights = torch.tensor([[0.5, 0.5, 0.25, 0.25, 0.0]])
    loss, stats = policy_loss(logprobs, torch.zeros(1, 5), advantages, weights, cliprange=0.2)
    loss.backward()
    close(loss.detach(), 0.0166667)
    close(logprobs.grad, [[0.0, 0.0, -0.1, 0.25, 0.0]])
    close(stats["clipfrac"], 0.5)  # stats stay plain token means
    loss, _ = policy_loss(logprobs.detach(), torch.zeros(1, 5), advantages, weights, 0.2, total_weight=2.0)
    close(loss, 0.0125)


def test_policy_loss_scales_each_tokens_surrogate_by_its_importance_weight():
    # the four per-token terms of the clipping test: [-1.2, 0.8, -0.6, 1.5], importance weights [2, 1, 0.5, 1]
    # loss = (-2.4 + 0.8 - 0.3 + 1.5) / 4 = -0.1
    # gradients (unclipped tokens only): t2 -A*ratio*w/4 = -0.6*0.5/4 = -0.075, t3 = 1.5*1/4 = 0.375
    logprobs = torch.log(torch.tensor([[1.5, 0.5, 0.6, 1.5, math.e**3]])).requires_grad_(True)
    advantages = torch.tensor([[1.0, -1.0, 1.0, -1.0, 5.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    importance = torch.tensor([[2.0, 1.0, 0.5, 1.0, 0.0]], requires_grad=True)
    loss, stats = policy_loss(logprobs, torch.zeros(1, 5), advantages, mask, 0.2, importance_weights=importance)
    loss.backward()
    close(loss.detach(), -0.1)
    close(logprobs.grad, [[0.0, 0.0, -0.075, 0.375, 0.0]])
    assert importance.grad is None  # a weight, not something to optimise
    close(stats["clipfrac"], 0.5)


def test_truncated_importance_weights_cap_the_trainer_over_sampler_ratio():
    # log pi_trainer - log pi_sampler = [0.5, 0, 2.5, ?, -1], cap 2
    # t0: e^0.5 = 1.6487213; t1: e^0 = 1; t2: e^2.5 = 12.18 -> 2 (capped); t3: sampler unknown -> 1;
    # t4: e^-1 = 0.3678794
    trainer = torch.tensor([-1.0, -2.0, -0.5, -3.0, -2.0])
    sampler = torch.tensor([-1.5, -2.0, -3.0, float("nan"), -1.0])
    weights, capped = truncated_importance_weights(trainer, sampler, cap=2.0)
    close(weights, [1.6487213, 1.0, 2.0, 1.0, 0.3678794])
    assert capped.tolist() == [False, False, True, False, False]


# ---------------------------------------------------------------- value loss
def test_value_loss_clipping_values_and_gradients():
    # cliprange_value 0.2, old values 0.5, returns 1.0
    # t0: V 1.0 -> clipped 0.7: errors 0 vs 0.09 -> clipped 0.09 selected, gradient 0
    # t1: V 0.6 -> inside the range: both 0.16, unclipped, d/dV = (V - R)/3 = -0.1333333
    # t2: V 0.0 -> clipped 0.3: errors 1.0 vs 0.49 -> unclipped 1.0, d/dV = (0 - 1)/3 = -0.3333333
    # t3: padding
    # loss = 0.5 * (0.09 + 0.16 + 1.0) / 3 = 0.2083333
    values = torch.tensor([[1.0, 0.6, 0.0, 7.0]], requires_grad=True)
    old_values = torch.tensor([[0.5, 0.5, 0.5, 0.0]])
    returns = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    loss, stats = value_loss(values, old_values, returns, torch.tensor([[1, 1, 1, 0]]), cliprange_value=0.2)
    loss.backward()
    close(loss.detach(), 0.2083333)
    close(values.grad, [[0.0, -0.1333333, -0.3333333, 0.0]])
    close(stats["vf_clipfrac"], 1 / 3)
    close(stats["value_mean"], 0.5333333)  # (1.0 + 0.6 + 0.0) / 3


def test_value_loss_weighted():
    # selected errors of the clipping test [0.09, 0.16, 1.0], weights [1, 0, 3]: 0.5 * (0.09 + 3.0) / 4 = 0.38625
    values = torch.tensor([[1.0, 0.6, 0.0]])
    loss, _ = value_loss(values, torch.full((1, 3), 0.5), torch.ones(1, 3), torch.tensor([[1.0, 0.0, 3.0]]), 0.2)
    close(loss, 0.38625)


def test_explained_variance():
    # R [1, 2, 3, 4] (Var 5/3), R - V [0, 0, 1, -1] (Var 2/3) -> 1 - (2/3)/(5/3) = 0.6
    values = torch.tensor([1.0, 2.0, 2.0, 5.0, 100.0])
    returns = torch.tensor([1.0, 2.0, 3.0, 4.0, -100.0])
    close(explained_variance(values, returns, torch.tensor([1, 1, 1, 1, 0])), 0.6)


def test_explained_variance_moments_stay_on_the_values_device():
    """On a GPU the values are CUDA tensors: every moment must be made there (the meta device stands in for
    CUDA on a CPU-only machine; a moment made on the CPU fails to stack with them)."""
    moments = explained_variance_moments(torch.zeros(3, device="meta"), torch.zeros(3, device="meta"))
    assert moments.device.type == "meta" and moments.shape == (5,)


def test_explained_variance_constant_returns_is_zero_not_nan():
    assert explained_variance(torch.tensor([0.0, 1.0]), torch.tensor([1.0, 1.0]), torch.ones(2)) == 0.0


# ---------------------------------------------------------------- KL penalty and controllers
def test_kl_penalty_kinds():
    # logp - ref = [0.5, -1.0]
    # k3 with d = ref - logp = [-0.5, 1.0]: e^-0.5 - 1 + 0.5 = 0.1065307, e^1 - 1 - 1 = 0.7182818
    logprobs = torch.tensor([[-1.0, -2.0]])
    ref_logprobs = torch.tensor([[-1.5, -1.0]])
    close(kl_penalty(logprobs, ref_logprobs, "k1"), [[0.5, -1.0]])
    close(kl_penalty(logprobs, ref_logprobs, "k2"), [[0.125, 0.5]])
    close(kl_penalty(logprobs, ref_logprobs, "k3"), [[0.1065307, 0.7182818]])
    close(kl_penalty(logprobs, ref_logprobs, "abs"), [[0.5, 1.0]])


def test_kl_penalty_unknown_kind_names_accepted_kinds():
    with pytest.raises(ValueError, match="k1.*k2.*k3.*abs"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k4")


def test_adaptive_kl_controller_trajectory_long_horizon():
    # n_steps/horizon = 8/10000 = 0.0008; errors clip to +0.2, -0.2, 0, -0.2
    # 0.2 * 1.00016 = 0.200032; * 0.99984 = 0.19999999488; * 1 = same; * 0.99984 = 0.1999679948808
    controller = AdaptiveKLController(init_kl_coef=0.2, target=6.0, horizon=10000)
    trajectory = []
    for kl in [12.0, 3.0, 6.0, 0.0]:
        controller.update(kl, n_steps=8)
        trajectory.append(controller.value)
    close(trajectory, [0.200032, 0.19999999488, 0.19999999488, 0.1999679948808], atol=1e-12)


def test_adaptive_kl_controller_trajectory_short_horizon():
    # n_steps/horizon = 0.1; KL 6.6 -> error 0.1 (inside the clip)
    # 0.2 * 1.02 = 0.204; * 0.98 = 0.19992; * 1 = 0.19992; * 0.98 = 0.1959216; * 1.01 = 0.197880816
    controller = AdaptiveKLController(0.2, 6.0, 100)
    trajectory = []
    for kl in [12.0, 3.0, 6.0, 0.0, 6.6]:
        controller.update(kl, n_steps=10)
        trajectory.append(controller.value)
    close(trajectory, [0.204, 0.19992, 0.19992, 0.1959216, 0.197880816], atol=1e-12)


def test_default_controller_moves_beta_within_a_short_run():
    # defaults: target 0.05 nats per token, horizon 100 episodes; 20 steps of 8 episodes at KL 0.1 per token
    # (error clipped to +0.2): beta = 0.2 * (1 + 0.2 * 8 / 100)^20 = 0.2 * 1.016^20 = 0.274729
    from ppo_affine.config import PPOConfig

    cfg = PPOConfig()
    controller = AdaptiveKLController(cfg.init_kl_coef, cfg.kl_target, cfg.kl_horizon)
    for _ in range(20):
        controller.update(0.1, n_steps=8)
    close(controller.value, 0.2747288, atol=1e-6)


def test_kl_controllers_state_round_trip():
    controller = AdaptiveKLController(0.2, 6.0, 100)
    controller.update(12.0, 10)
    restored = AdaptiveKLController(0.5, 6.0, 100)
    restored.load_state_dict(controller.state_dict())
    assert restored.value == controller.value
    close(restored.value, 0.204, atol=1e-12)
    fixed = FixedKLController(0.05)
    fixed.update(100.0, 10)
    assert fixed.value == 0.05
    other = FixedKLController(1.0)
    other.load_state_dict(fixed.state_dict())
    assert other.value == 0.05


def test_trace_line_credit_pays_a_missed_trace_reply_a_share_below_an_exact_match():
    from ppo_affine.advantages import final_reward
    from ppo_affine.config import PPOConfig
    from ppo_affine.envs.tasks import Task
    from ppo_affine.rollout import Episode

    def episode(kind, score, credit):
        return Episode(Task(kind, 3_000_000, 0, None, "s", False), kind, score=score, info={"line_credit": credit})

    shaped = PPOConfig(reward={"trace_line_credit": 0.5})
    assert final_reward(episode("trace", 0.0, 0.6), shaped) == pytest.approx(0.3)  # 0.5 x 0.6
    assert final_reward(episode("trace", 1.0, 1.0), shaped) == 1.0
    assert final_reward(episode("openspiel", 0.0, 0.6), shaped) == 0.0  # games: the score alone
    assert final_reward(episode("trace", 0.0, 0.6), PPOConfig()) == 0.0  # off by default
    centered = PPOConfig(reward={"trace_line_credit": 0.5, "center_score": True})
    assert final_reward(episode("trace", 0.0, 0.6), centered) == pytest.approx(-0.2)


# DISTILL-V2's cell score. c = (0.5, 1, 2), rewards (1, 0, 0): a = z-scores = (sqrt 2, -1/sqrt 2, -1/sqrt 2);
# tau = pstd(c) = 0.623610; p = softmax(-c / tau) = (0.649873, 0.291486, 0.058641); S = sum p a = 0.671482.
CELL_NLL = torch.tensor([0.5, 1.0, 2.0])
CELL_ADVANTAGES = torch.tensor([math.sqrt(2), -1 / math.sqrt(2), -1 / math.sqrt(2)])


def test_softmax_advantage_score_by_hand():
    close(softmax_advantage_score(CELL_NLL, CELL_ADVANTAGES), 0.671482, atol=1e-6)


def test_softmax_advantage_score_is_scale_and_shift_free():
    close(softmax_advantage_score(3 * CELL_NLL + 7, CELL_ADVANTAGES), 0.671482, atol=1e-6)


def test_softmax_advantage_without_preference_is_the_mean_advantage():
    close(softmax_advantage_score(torch.tensor([1.5, 1.5, 1.5]), CELL_ADVANTAGES), 0.0)
    close(softmax_advantage_score(torch.tensor([0.7]), torch.tensor([0.0])), 0.0)
    score, gradient = softmax_advantage_gradient(torch.tensor([1.5, 1.5, 1.5]), CELL_ADVANTAGES)
    assert score == pytest.approx(0.0) and gradient.tolist() == [0.0, 0.0, 0.0]


def test_softmax_advantage_gradient_goes_through_tau():
    # Central differences of S by hand-free arithmetic (math only, no torch): (-0.478789, 0.718183, -0.239394).
    # Scale-freeness makes the gradient orthogonal to c and to 1; with tau held fixed it would not be.
    score, gradient = softmax_advantage_gradient(CELL_NLL, CELL_ADVANTAGES)
    assert score == pytest.approx(0.671482, abs=1e-6)
    close(gradient, [-0.478789, 0.718183, -0.239394], atol=2e-6)
    close(gradient.sum(), 0.0, atol=1e-9)
    close((gradient * CELL_NLL.double()).sum(), 0.0, atol=1e-9)


def test_softmax_advantage_floor_keeps_tied_rollouts_trainable():
    # Tied c's: tau = floor 0.1, p uniform, dS/dc_i = -(a_i - mean a) / (N tau) = -a_i / 0.3.
    score, gradient = softmax_advantage_gradient(torch.tensor([1.0, 1.0, 1.0]), CELL_ADVANTAGES, tau_floor=0.1)
    assert score == pytest.approx(0.0, abs=1e-12)
    close(gradient, [-math.sqrt(2) / 0.3, 1 / math.sqrt(2) / 0.3, 1 / math.sqrt(2) / 0.3], atol=1e-6)  # a in float32


def test_two_pass_cell_gradient_equals_autograd_through_the_whole_cell():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(11, 8), torch.nn.Tanh(), torch.nn.Linear(8, 11)).double()
    rollouts = [torch.randint(0, 11, (n,)) for n in (5, 9, 3, 7)]
    advantages = torch.tensor([1.2, -0.4, 0.3, -1.1])

    def nll_per_token(tokens):  # next-token NLL, mean over the rollout's predicted tokens
        return torch.nn.functional.cross_entropy(model(tokens[:-1]), tokens[1:])

    whole = softmax_advantage_score(torch.stack([nll_per_token(r) for r in rollouts]), advantages)
    whole_gradients = torch.autograd.grad(whole, list(model.parameters()))

    with torch.no_grad():
        nll = torch.stack([nll_per_token(r) for r in rollouts])
    score, weights = softmax_advantage_gradient(nll, advantages)
    model.zero_grad()
    for rollout, weight in zip(rollouts, weights):  # one rollout's graph at a time
        (weight * nll_per_token(rollout)).backward()
    assert score == pytest.approx(whole.item(), abs=1e-12)
    for two_pass, expected in zip((p.grad for p in model.parameters()), whole_gradients):
        torch.testing.assert_close(two_pass, expected, atol=1e-12, rtol=0)
    assert max(g.abs().max().item() for g in whole_gradients) > 1e-3  # a real gradient, not zeros equal to zeros
