"""update.py on a tiny model: critic warm-up leaves the policy alone, KL early stop, no entropy at coef 0."""
import pytest
import torch

from ppo_affine import ppo as ppo_module
from ppo_affine.distributed import ONE_PROCESS
from ppo_affine.envs.tasks import Task
from ppo_affine.advantages import assign_advantages
from ppo_affine.batching import build_sequences, collate
from ppo_affine.experience import score_sequences
from ppo_affine.rollout import Episode, Turn
from ppo_affine.update import (MinibatchWeights, TrainingSnapshot, UpdateSettings, UpdateState, build_optimizer,
                               micro_batch_loss, ppo_update, update_signal)
from ppo_affine.config import PPOConfig


def episodes_for(policy, n=6):
    tok = policy.tokenizer
    prompt = tok("<|im_start|>user\nplay<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    replies = [tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
               for text in ("3 7", "the game", "1", "Raise", "0", "call it")]
    episodes = []
    for i in range(n):
        reply = replies[i % len(replies)]
        episodes.append(Episode(task=Task("e", i, i, None, "s", False), env_kind="openspiel", done=True,
                                turns=[Turn(reply, "", None, sequence=0, start=len(prompt))],
                                sequences=[prompt + reply], score=float(i % 2), game_name="g"))
    return episodes


def settings(cfg, seed=0, value_only=False):
    """One step's update settings: beta 0, temperature 1, the config's token budget."""
    return UpdateSettings(cfg, 0.0, 1.0, cfg.micro_batch_tokens, shuffle_seed=seed, value_only=value_only)


def prepared(policy, cfg):
    episodes = episodes_for(policy)
    sequences = build_sequences(episodes)
    score_sequences(policy, sequences, cfg.micro_batch_tokens, 1.0, with_values=True)
    assign_advantages(sequences, episodes, cfg, 0.0, None)
    return sequences


def current_logprobs(policy, sequences):
    batch = collate(sequences, policy.tokenizer.pad_token_id, policy.device)
    with torch.no_grad():
        return policy.score(batch.input_ids, None, batch.response_mask, with_values=False).logprobs


def test_critic_warm_up_moves_the_value_head_and_not_the_policy(tiny_policy):
    cfg = PPOConfig(learning_rate=1e-2, ppo_epochs=3, vf_coef=1.0, kl_stop=None)
    sequences = prepared(tiny_policy, cfg)
    lora_before = {n: p.detach().clone() for n, p in tiny_policy.named_parameters() if "lora_" in n}
    value_before = tiny_policy.value_head.weight.detach().clone()
    logprobs_before = current_logprobs(tiny_policy, sequences)
    optimizer = build_optimizer(tiny_policy, cfg, value_lr=1e-2)
    stats = ppo_update(tiny_policy, optimizer, sequences, settings(cfg, value_only=True), UpdateState())
    assert "value/loss" in stats and "policy/loss" not in stats
    assert all(torch.equal(p, lora_before[n]) for n, p in tiny_policy.named_parameters() if "lora_" in n)
    assert torch.equal(current_logprobs(tiny_policy, sequences), logprobs_before)
    assert not torch.equal(tiny_policy.value_head.weight, value_before)


def test_a_minibatch_past_kl_stop_is_not_stepped_and_ends_the_epochs(tiny_policy):
    # epoch 1 starts at ratio 1 (KL 0) and steps; by epoch 2 the policy has moved past the tiny limit
    cfg = PPOConfig(learning_rate=5e-2, ppo_epochs=4, kl_stop=1e-6)
    sequences = prepared(tiny_policy, cfg)
    state = UpdateState()
    stats = ppo_update(tiny_policy, build_optimizer(tiny_policy, cfg, 1e-2), sequences, settings(cfg), state)
    assert stats["update/early_stopped"] == 1.0 and stats["update/epochs_run"] == 2.0
    assert state.optimizer_steps == 1


def test_no_entropy_is_computed_in_the_update_when_its_coefficient_is_zero(tiny_policy, monkeypatch):
    cfg = PPOConfig(learning_rate=1e-3, ppo_epochs=1)
    sequences = prepared(tiny_policy, cfg)
    assert all(s.entropy is not None for s in sequences)  # the scoring pass logs the rollout policy's

    def forbidden(*args, **kwargs):
        raise AssertionError("full-vocabulary entropy computed in the update")

    monkeypatch.setattr(ppo_module, "_label_logprob_and_entropy", forbidden)  # the LM head's chunks, with entropy
    stats = ppo_update(tiny_policy, build_optimizer(tiny_policy, cfg, 1e-3), sequences, settings(cfg), UpdateState())
    assert "policy/entropy_bonus" not in stats
    cfg = PPOConfig(learning_rate=1e-3, ppo_epochs=1, entropy_coef=0.01)
    monkeypatch.undo()
    stats = ppo_update(tiny_policy, build_optimizer(tiny_policy, cfg, 1e-3), sequences, settings(cfg), UpdateState())
    assert stats["policy/entropy_bonus"] > 0


def adapter_gradients(policy, cfg, sequences):
    """One micro-batch's loss terms and the gradient it puts on every LoRA parameter."""
    batch = collate(sequences, policy.tokenizer.pad_token_id, policy.device)
    weights = MinibatchWeights.of(sequences, use_critic=True, ranks=ONE_PROCESS)
    policy.zero_grad(set_to_none=True)
    result = micro_batch_loss(policy, batch, settings(cfg), weights)
    result.loss.backward()
    return result.terms, {n: p.grad.clone() for n, p in policy.named_parameters() if "lora_" in n}


def test_an_entropy_cap_below_every_token_leaves_the_bonus_without_gradient(tiny_policy):
    # the tiny random model's tokens carry several nats; capped at 0.01 nats the bonus is a constant
    plain = PPOConfig(entropy_coef=0.0)
    sequences = prepared(tiny_policy, plain)
    assert min(s.entropy.min().item() for s in sequences) > 0.01
    _, without_bonus = adapter_gradients(tiny_policy, plain, sequences)
    capped = plain.model_copy(update={"entropy_coef": 0.5, "entropy_cap": 0.01})
    terms, with_capped_bonus = adapter_gradients(tiny_policy, capped, sequences)
    assert terms["policy/entropy_bonus"] == pytest.approx(0.01)  # every token counted at the cap
    for name, grad in without_bonus.items():
        torch.testing.assert_close(with_capped_bonus[name], grad, rtol=1e-4, atol=1e-7)
    # a cap above every token is no cap: the same bonus changes the gradient
    loose = plain.model_copy(update={"entropy_coef": 0.5, "entropy_cap": 1e3})
    terms, with_loose_bonus = adapter_gradients(tiny_policy, loose, sequences)
    assert terms["policy/entropy_bonus"] > 1.0
    assert max((with_loose_bonus[n] - without_bonus[n]).abs().max().item() for n in without_bonus) > 1e-4


# ---------------------------------------------------------------- the training signal's direction
def two_turn_episodes(policy, scores):
    """Two-turn games held in one sequence each, with a different pair of replies per episode."""
    tok = policy.tokenizer
    encode = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompt = encode("<|im_start|>user\nplay<|im_end|>\n<|im_start|>assistant\n")
    glue = [tok.eos_token_id] + encode("\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n")
    words = ["Raise", "Call", "Fold", "Liar", "bid", "card", "dice", "game", "point", "score", "legal", "action"]
    episodes = []
    for i, score in enumerate(scores):
        first, second = encode(f"{words[i % 12]} {i}"), encode(f"{words[(i + 5) % 12]} {2 * i}")
        sequence = prompt + first + glue + second + [tok.eos_token_id]
        turns = [Turn(first, "", None, sequence=0, start=len(prompt)),
                 Turn(second + [tok.eos_token_id], "", None, sequence=0, start=len(prompt + first + glue))]
        episodes.append(Episode(task=Task("e", i, i, None, "s", False), env_kind="openspiel", done=True,
                                turns=turns, sequences=[sequence], score=score, game_name="g"))
    return episodes


def one_update_signal(policy, cfg, episodes, group_ids=None):
    sequences = build_sequences(episodes)
    score_sequences(policy, sequences, cfg.micro_batch_tokens, 1.0, with_values=cfg.advantage == "gae")
    assign_advantages(sequences, episodes, cfg, 0.0, group_ids)
    ppo_update(policy, build_optimizer(policy, cfg, 1e-3), sequences, settings(cfg), UpdateState())
    return update_signal(policy, sequences, settings(cfg))


def test_one_update_raises_replies_with_positive_advantage_and_lowers_the_others_turn_credit(tiny_policy):
    cfg = PPOConfig(learning_rate=2e-3, ppo_epochs=1, kl_stop=None, credit="turn")
    scores = [1.0, 0.0, 0.75, 0.25, 1.0, 0.0, 0.5, 0.9]
    signal = one_update_signal(tiny_policy, cfg, two_turn_episodes(tiny_policy, scores))
    assert signal["signal/advantage_logprob_corr"] > 0.7
    assert signal["signal/logprob_change_positive"] > 0 > signal["signal/logprob_change_negative"]


def test_one_update_raises_replies_with_positive_advantage_and_lowers_the_others_group(tiny_policy):
    cfg = PPOConfig(learning_rate=2e-3, ppo_epochs=1, kl_stop=None, advantage="group", group_size=4)
    scores = [1.0, 0.0, 0.5, 0.0, 0.2, 0.9, 0.9, 0.4]
    signal = one_update_signal(tiny_policy, cfg, two_turn_episodes(tiny_policy, scores), [0, 0, 0, 0, 1, 1, 1, 1])
    assert signal["signal/advantage_logprob_corr"] > 0.7
    assert signal["signal/logprob_change_positive"] > 0 > signal["signal/logprob_change_negative"]


def test_explained_variance_is_taken_over_the_whole_minibatch_not_per_micro_batch(tiny_policy):
    from ppo_affine.ppo import explained_variance

    for module in tiny_policy.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0  # the update's forward then sees the values the scoring pass saw
    with torch.no_grad():
        tiny_policy.value_head.weight.normal_(0.0, 0.5)  # values that vary, so the variance is informative
    cfg = PPOConfig(learning_rate=1e-3, ppo_epochs=1, micro_batch_tokens=64)  # one sequence per micro-batch
    sequences = prepared(tiny_policy, cfg)
    values = torch.cat([s.old_values[s.value_weights != 0] for s in sequences])
    returns = torch.cat([s.returns[s.value_weights != 0] for s in sequences])
    expected = explained_variance(values, returns, torch.ones_like(values))
    stats = ppo_update(tiny_policy, build_optimizer(tiny_policy, cfg, 1e-3), sequences, settings(cfg), UpdateState())
    assert stats["value/explained_variance"] == pytest.approx(expected, abs=1e-4)


class Stop(Exception):
    pass


def test_the_sampler_correction_weighs_the_policy_loss_and_nothing_else(tiny_policy):
    cfg = PPOConfig(vf_coef=1.0)
    sequences = prepared(tiny_policy, cfg)
    for sequence in sequences:
        sequence.importance_weights = torch.full((sequence.response_len,), 0.5)
    batch = collate(sequences, tiny_policy.tokenizer.pad_token_id, tiny_policy.device)
    weights = MinibatchWeights.of(sequences, use_critic=True, ranks=ONE_PROCESS)

    def terms(correct: bool) -> dict[str, float]:
        corrected = cfg.model_copy(update={"sampler_correction": correct})
        return micro_batch_loss(tiny_policy, batch, settings(corrected), weights).terms

    plain, halved = terms(False), terms(True)
    assert plain["policy/loss"] != 0
    assert halved["policy/loss"] == pytest.approx(0.5 * plain["policy/loss"], rel=1e-6)
    assert halved["value/loss"] == plain["value/loss"]


def test_an_update_abandoned_halfway_is_undone_by_its_snapshot(tiny_policy):
    """A stop (or out-of-memory) after some optimizer steps: weights, moments and counters return to the start."""
    cfg = PPOConfig(learning_rate=1e-2, ppo_epochs=2, num_minibatches=2, kl_stop=None)
    sequences = prepared(tiny_policy, cfg)
    optimizer = build_optimizer(tiny_policy, cfg, value_lr=1e-2)
    state = UpdateState()
    ppo_update(tiny_policy, optimizer, sequences, settings(cfg), state)
    weights_before = {n: p.detach().clone() for n, p in tiny_policy.named_parameters() if p.requires_grad}
    moments_before = {n: optimizer.state[p]["exp_avg"].clone() for n, p in tiny_policy.named_parameters()
                      if p.requires_grad}
    snapshot = TrainingSnapshot.take(optimizer, state)
    checks = []

    def stop_at_the_third_minibatch():
        checks.append(1)
        if len(checks) == 3:
            raise Stop

    for _ in range(2):  # a retried step may be abandoned again: the snapshot must survive a restore
        checks.clear()
        with pytest.raises(Stop):
            ppo_update(tiny_policy, optimizer, sequences, settings(cfg, seed=1), state,
                       check_stop=stop_at_the_third_minibatch)
        assert state.optimizer_steps == 4 + 2  # two steps were taken before the stop
        assert any(not torch.equal(p, weights_before[n]) for n, p in tiny_policy.named_parameters() if p.requires_grad)
        snapshot.restore(optimizer, state)
        assert state.optimizer_steps == 4
        for name, parameter in tiny_policy.named_parameters():
            if parameter.requires_grad:
                assert torch.equal(parameter, weights_before[name]), name
                assert torch.equal(optimizer.state[parameter]["exp_avg"], moments_before[name]), name
