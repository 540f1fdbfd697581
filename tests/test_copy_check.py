"""The validators' copy statistic: decision positions per side, their union with a missing side at 0, the pooled
median, the 50-position floor, and log-probs by teacher forcing.

The statistic's expected numbers are what affine-cortex's own `compare_scores` + `is_copy_verdict` (commit c2d7ec8,
`anticopy/pairwise.py`, threshold 0.05, min_overlap 50) returned on the same log-prob lists (v2 `resp_lp` rollouts),
run in a side environment (their lists are float32: 0.5 came back as 0.49999997).
"""
import pytest
import torch

from ppo_affine.config import ValidatorRuleConfig
from ppo_affine.copy_check import (COPY, NOT_A_COPY, TOO_FEW, assistant_tokens, copy_statistic, decision_gaps,
                                   teacher_forced_logprobs)
from ppo_affine.testing.tiny import activate_adapter, load_tiny_policy, make_tiny_model_dir

RULE = ValidatorRuleConfig()


def test_union_of_both_sides_decision_positions_with_a_missing_side_at_zero():
    candidate = [-0.1, -0.6, -1.0, -0.2, -2.0]  # flags positions 1, 2, 4
    champion = [-0.1, -0.7, -0.3, -0.9, -2.0]  # flags 1, 3, 4; its -0.3 at position 2 counts as 0, not -0.3
    assert decision_gaps(candidate, champion, -0.5) == pytest.approx([0.1, 1.0, 0.9, 0.0])
    statistic = copy_statistic({"r1": candidate}, {"r1": champion}, {"r1": "game"}, RULE)
    assert statistic.median == pytest.approx(0.5)
    assert (statistic.positions, statistic.rollouts, statistic.verdict) == (4, 1, TOO_FEW)


def test_a_pooled_median_below_0_05_is_a_copy():
    candidate = {"r1": [-0.5625] * 30 + [-0.01] * 5, "r2": [-0.5625] * 30}  # the confident tokens do not count
    champion = {"r1": [-0.59375] * 30 + [-0.01] * 5, "r2": [-0.59375] * 30}
    statistic = copy_statistic(candidate, champion, {"r1": "game", "r2": "trace"}, RULE)
    assert (statistic.median, statistic.positions, statistic.rollouts) == (0.03125, 60, 2)
    assert statistic.per_env == {"game": (0.03125, 30), "trace": (0.03125, 30)}
    assert statistic.verdict == COPY


def test_a_median_above_0_05_is_not_a_copy():
    statistic = copy_statistic({"r1": [-0.75] * 60}, {"r1": [-0.6875] * 60}, {"r1": "game"}, RULE)
    assert (statistic.median, statistic.positions, statistic.verdict) == (0.0625, 60, NOT_A_COPY)


@pytest.mark.parametrize("positions, verdict", [(49, TOO_FEW), (50, COPY)])
def test_fewer_than_50_positions_give_no_verdict(positions, verdict):
    statistic = copy_statistic({"r1": [-0.75] * positions}, {"r1": [-0.75] * positions}, {"r1": "game"}, RULE)
    assert (statistic.median, statistic.verdict) == (0.0, verdict)


def test_envs_are_pooled_into_one_median_not_voted():
    statistic = copy_statistic({"a": [-1.0] * 40, "b": [-1.0] * 21}, {"a": [-1.0] * 40, "b": [-2.0] * 21},
                               {"a": "game", "b": "trace"}, RULE)
    assert statistic.per_env == {"game": (0.0, 40), "trace": (1.0, 21)}
    assert (statistic.median, statistic.positions, statistic.verdict) == (0.0, 61, COPY)


def test_only_rollouts_both_models_scored_count():
    statistic = copy_statistic({"a": [-1.0] * 60, "x": [-3.0] * 60}, {"a": [-1.0] * 60, "y": [-3.0] * 60},
                               {"a": "game", "x": "game", "y": "game"}, RULE)
    assert (statistic.median, statistic.positions, statistic.rollouts) == (0.0, 60, 1)


# ---------------------------------------------------------------------- teacher forcing on toy model pairs
CONVERSATIONS = [
    [{"role": "user", "content": "You are playing leduc_poker. Legal actions: 0 -> Fold, 1 -> Call, 2 -> Raise."},
     {"role": "assistant", "content": "I hold the king, so I raise: the opponent folds weaker cards. Action: 2"},
     {"role": "user", "content": "The opponent calls. Round two. Legal actions: 1 -> Call, 2 -> Raise."},
     {"role": "assistant", "content": "The board card pairs my king. Raise again for value. Action: 2"}],
    [{"role": "user", "content": "What does this program print? print(sum(range(4)))"},
     {"role": "assistant", "content": "sum(range(4)) adds 0, 1, 2 and 3, so the program prints 6."}],
]


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("copy-check")
    return make_tiny_model_dir(root / "champion", seed=0), make_tiny_model_dir(root / "unrelated", seed=1)


def scored(policy, conversations):
    rollouts = {}
    for index, messages in enumerate(conversations):
        ids, mask = assistant_tokens(policy.tokenizer, messages)
        rollouts[f"r{index}"] = teacher_forced_logprobs(policy, ids, mask)
    return rollouts


def test_assistant_tokens_are_the_assistant_message_bodies(tiny_dirs):
    policy = load_tiny_policy(tiny_dirs[0])
    ids, mask = assistant_tokens(policy.tokenizer, CONVERSATIONS[1])
    marked = policy.tokenizer.decode([t for t, m in zip(ids, mask) if m])
    assert marked == "sum(range(4)) adds 0, 1, 2 and 3, so the program prints 6."
    assert not mask[0] and len(ids) == len(mask)


def test_teacher_forced_logprobs_are_the_models_next_token_logprobs(tiny_dirs):
    policy = load_tiny_policy(tiny_dirs[0])
    ids, mask = assistant_tokens(policy.tokenizer, CONVERSATIONS[1])
    with torch.no_grad():
        logits = policy.model(input_ids=torch.tensor([ids])).logits[0]  # [T, V]
    expected = [torch.log_softmax(logits[t - 1].float(), -1)[ids[t]].item() for t in range(1, len(ids)) if mask[t]]
    assert teacher_forced_logprobs(policy, ids, mask) == pytest.approx(expected, abs=1e-5)


def test_an_identical_copy_has_statistic_zero(tiny_dirs):
    policy = load_tiny_policy(tiny_dirs[0])  # a fresh adapter (B = 0) is the base model exactly
    with policy.base():
        champion = scored(policy, CONVERSATIONS)
    statistic = copy_statistic(scored(policy, CONVERSATIONS), champion, {}, RULE)
    assert statistic.positions >= 50  # a random model is unsure of nearly every token
    assert (statistic.median, statistic.verdict) == (0.0, COPY)


def test_a_copy_with_small_noise_stays_under_the_line(tiny_dirs):
    policy = load_tiny_policy(tiny_dirs[0])
    with policy.base():
        champion = scored(policy, CONVERSATIONS)
    activate_adapter(policy.model, 1e-3)  # a light fine-tune of the champion
    statistic = copy_statistic(scored(policy, CONVERSATIONS), champion, {}, RULE)
    assert 0.0 < statistic.median < 0.05
    assert statistic.verdict == COPY


def test_an_unrelated_model_is_not_a_copy(tiny_dirs):
    champion = scored(load_tiny_policy(tiny_dirs[0]), CONVERSATIONS)
    unrelated = scored(load_tiny_policy(tiny_dirs[1]), CONVERSATIONS)  # same tokenizer, other weights
    statistic = copy_statistic(unrelated, champion, {}, RULE)
    assert statistic.median > 0.5
    assert statistic.verdict == NOT_A_COPY
