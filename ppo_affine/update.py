"""The PPO update: epochs over shuffled minibatches of sequences, micro-batches packed by a token budget.

`ppo_update` (epochs and minibatches, the KL stop) -> `accumulate_gradients` (one minibatch: this
rank's micro-batches in `backward_micro_batches`, forward, `micro_batch_loss`, backward, then the
statistics over the ranks) -> `step_optimizer` (gradients summed over the ranks, clipped, then the
step, or a skip when they are not finite). What every level reads of the step (the PPO config, beta,
the temperature, the token budget, the critic warm-up) is one `UpdateSettings`. `update_signal`
re-scores the batch afterwards to check the update's direction.
"""
from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ppo_affine.distributed import ONE_PROCESS, Ranks
from ppo_affine.batching import Batch, TrainSequence, micro_batches
from ppo_affine.oom_recovery import blamed_on
from ppo_affine.policy import Policy
from ppo_affine.ppo import (explained_variance_from_moments, explained_variance_moments, kl_penalty, pearson_correlation,
                 policy_loss, value_loss, weighted_mean)
from ppo_affine.config import PPOConfig

log = logging.getLogger(__name__)


class TooManySkips(RuntimeError):
    """Raised after `max_consecutive_skips` non-finite updates in a row."""


@dataclass
class UpdateState:
    """Counters that outlive one step (they go into checkpoints)."""
    skipped_updates: int = 0
    consecutive_skips: int = 0
    optimizer_steps: int = 0
    history: list[str] = field(default_factory=list)


@dataclass
class TrainingSnapshot:
    """The trainable weights, optimizer moments and update counters before a step's update, in CPU
    memory (LoRA and the value head are small), so that an update abandoned halfway (a stop signal,
    CUDA out of memory) can be undone and the step saved or retried as if it had not started."""
    parameters: list[torch.Tensor]
    optimizer: dict[str, Any]
    counters: dict[str, Any]

    @classmethod
    def take(cls, optimizer: torch.optim.Optimizer, state: UpdateState) -> TrainingSnapshot:
        parameters = [p.detach().to("cpu", copy=True) for group in optimizer.param_groups for p in group["params"]]
        return cls(parameters, _to_cpu(optimizer.state_dict()), copy.deepcopy(vars(state)))

    def restore(self, optimizer: torch.optim.Optimizer, state: UpdateState) -> None:
        with torch.no_grad():
            live = [p for group in optimizer.param_groups for p in group["params"]]
            for parameter, saved in zip(live, self.parameters, strict=True):
                parameter.copy_(saved)
        optimizer.zero_grad(set_to_none=True)
        # a copy: on CPU load_state_dict keeps the given tensors, which the next step would change in place
        optimizer.load_state_dict(_to_cpu(self.optimizer))
        for name, value in copy.deepcopy(self.counters).items():
            setattr(state, name, value)


def _to_cpu(value: Any) -> Any:
    """A copy of an optimizer state dict with every tensor copied to CPU memory."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: _to_cpu(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_to_cpu(item) for item in value]
    return value


def build_optimizer(policy: Policy, cfg: PPOConfig, value_lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        [
            {"params": policy.adapter_parameters(), "lr": cfg.learning_rate, "name": "adapter"},
            {"params": list(policy.value_head.parameters()), "lr": value_lr, "name": "value_head"},
        ],
        weight_decay=0.0,
    )


@dataclass(frozen=True)
class UpdateSettings:
    """What every level of one step's update reads."""
    ppo: PPOConfig
    kl_coef: float  # beta this step (group mode puts the KL into the loss)
    temperature: float  # the sampling temperature: replies are scored at the distribution they were drawn from
    micro_batch_tokens: int  # the token budget of one forward/backward pass (halved after CUDA runs out of memory)
    shuffle_seed: int  # seeds this step's minibatch order
    value_only: bool = False  # critic warm-up: the value head alone trains, on a detached trunk


def ppo_update(policy: Policy, optimizer: torch.optim.Optimizer, sequences: list[TrainSequence],
               settings: UpdateSettings, state: UpdateState, *, task_ids: list[int] | None = None,
               ranks: Ranks = ONE_PROCESS, check_stop: Callable[[], None] = lambda: None) -> dict[str, float]:
    """`ppo_epochs` passes; returns the mean of each logged statistic over optimizer steps.

    Before each optimizer step the minibatch's approximate KL (k3, per token) to the rollout policy
    is known from its forward pass; past `kl_stop` the step is not taken and the epochs end.
    With several ranks `sequences` is this rank's share of the batch (shares in rank order):
    minibatches are drawn over the whole batch, each rank trains its members of each, and weights,
    statistics and gradients are summed over the ranks, so every rank takes the same steps.
    `task_ids` name the batch's tasks in the warning of a skipped step. `check_stop` runs before every
    minibatch (on every rank alike) and raises to abandon the update."""
    cfg = settings.ppo
    generator = torch.Generator().manual_seed(settings.shuffle_seed)
    stats: dict[str, list[float]] = {}
    early_stop = False
    first, total = ranks.offset(len(sequences))
    policy.train()
    for epoch in range(cfg.ppo_epochs):
        order = torch.randperm(total, generator=generator).tolist()
        minibatches = [order[i :: cfg.num_minibatches] for i in range(cfg.num_minibatches)]
        for minibatch in minibatches:
            if not minibatch:
                continue
            check_stop()
            mine = [sequences[i - first] for i in minibatch if first <= i < first + len(sequences)]
            gradients = accumulate_gradients(policy, mine, settings, ranks)
            step_stats = step_optimizer(optimizer, gradients, cfg, state, task_ids or [], ranks)
            early_stop = step_stats.pop("update/kl_stopped", 0.0) > 0
            for key, value in step_stats.items():
                stats.setdefault(key, []).append(value)
            if early_stop:
                break
        if early_stop:
            break
    summary = {key: sum(values) / len(values) for key, values in stats.items() if values}
    summary["update/epochs_run"] = float(epoch + 1)
    summary["update/early_stopped"] = float(early_stop)
    summary["update/skipped_total"] = float(state.skipped_updates)
    return summary


@dataclass
class MinibatchWeights:
    """A minibatch's reply tokens and total loss weights over every rank: each rank divides its loss terms
    by these, so that they add up over micro-batches and ranks to the whole minibatch's loss."""
    tokens: float
    policy: float
    value: float  # 0 without a critic

    @classmethod
    def of(cls, minibatch: list[TrainSequence], use_critic: bool, ranks: Ranks) -> MinibatchWeights:
        tokens, policy, value = ranks.sum(torch.tensor([
            float(sum(s.response_len for s in minibatch)),
            float(sum(s.token_weights.sum() for s in minibatch)),
            float(sum(s.value_weights.sum() for s in minibatch)) if use_critic else 0.0,
        ], dtype=torch.float64)).tolist()
        return cls(tokens, policy, value)


@dataclass
class MicroBatchLoss:
    loss: torch.Tensor  # this micro-batch's part of the minibatch's loss
    terms: dict[str, float]  # loss terms, already divided by the minibatch's weight: they add up
    means: dict[str, float]  # other statistics, means over this micro-batch's tokens
    values: torch.Tensor | None = None  # [V] predicted values at the value positions, detached
    returns: torch.Tensor | None = None  # [V] their targets


@dataclass
class AccumulatedGradients:
    """A minibatch's gradients, in the parameters' `.grad`, and what the pass measured."""
    finite: bool  # every micro-batch's loss was finite, on every rank
    stats: dict[str, float]  # the minibatch's statistics over every rank


def micro_batch_loss(policy: Policy, batch: Batch, settings: UpdateSettings, weights: MinibatchWeights
                     ) -> MicroBatchLoss:
    """The clipped policy loss, entropy bonus and (group mode) KL loss, and the clipped value loss, of one
    collated micro-batch."""
    cfg, kl_coef = settings.ppo, settings.kl_coef
    use_critic, train_policy = cfg.advantage == "gae", not settings.value_only
    scored = policy.score(batch.input_ids, None, batch.response_mask, tree=batch.tree, with_values=use_critic,
                          with_logprobs=train_policy, with_entropy=train_policy and cfg.entropy_coef > 0,
                          detach_trunk=settings.value_only, temperature=settings.temperature)
    loss = torch.zeros((), device=policy.device)
    terms: dict[str, float] = {}
    means: dict[str, float] = {}
    if train_policy:
        pg_loss, pg_stats = policy_loss(scored.logprobs, batch.old_logprobs, batch.advantages, batch.token_weights,
                                        cfg.cliprange, total_weight=weights.policy,
                                        importance_weights=batch.importance_weights if cfg.sampler_correction
                                        else None)
        loss = loss + pg_loss
        terms["policy/loss"] = pg_loss.item()
        means.update({f"policy/{k}": float(v) for k, v in pg_stats.items()})
        if scored.entropy is not None:
            token_entropy = scored.entropy
            if cfg.entropy_cap is not None:  # a token at or past the cap gets no gradient from the bonus
                token_entropy = token_entropy.clamp(max=cfg.entropy_cap)
            entropy = weighted_mean(token_entropy, batch.token_weights, weights.policy)
            loss = loss - cfg.entropy_coef * entropy
            terms["policy/entropy_bonus"] = entropy.item()
        if not use_critic and kl_coef > 0:  # group mode keeps the reference close through the loss
            kl_loss = weighted_mean(kl_penalty(scored.logprobs, batch.ref_logprobs, "k3"), batch.token_weights,
                                    weights.policy)
            loss = loss + kl_coef * kl_loss
            terms["policy/kl_loss"] = kl_loss.item()
    if not (use_critic and weights.value > 0):
        return MicroBatchLoss(loss, terms, means)
    vf_loss, vf_stats = value_loss(scored.values, batch.old_values, batch.returns, batch.value_weights,
                                   cfg.cliprange_value, total_weight=weights.value)
    terms["value/loss"] = vf_loss.item()
    means.update({f"value/{k}": float(v) for k, v in vf_stats.items()})
    value_mask = batch.value_weights != 0
    return MicroBatchLoss(loss + cfg.vf_coef * vf_loss, terms, means, scored.values.detach()[value_mask],
                          batch.returns[value_mask])


@dataclass
class MicroBatchPasses:
    """What one rank's forward and backward passes over its part of a minibatch measured."""
    finite: bool  # every micro-batch's loss was finite
    sums: dict[str, float]  # loss terms and token-weighted means, to be summed over the ranks
    values: list[torch.Tensor]  # each micro-batch's predicted values, detached
    returns: list[torch.Tensor]  # and their targets


def accumulate_gradients(policy: Policy, minibatch: list[TrainSequence], settings: UpdateSettings, ranks: Ranks
                         ) -> AccumulatedGradients:
    """Forward and backward through this rank's part of a minibatch, micro-batches packed by the token budget,
    the gradients adding up in `.grad`. A non-finite loss ends the pass; statistics are over every rank. CUDA out
    of memory on any rank raises OutOfMemoryOnRanks on every rank."""
    use_critic = settings.ppo.advantage == "gae"
    weights = MinibatchWeights.of(minibatch, use_critic, ranks)
    policy.zero_grad(set_to_none=True)  # this minibatch's gradients alone
    passes = ranks.agree_on_memory(lambda: backward_micro_batches(policy, minibatch, settings, weights))
    finite = not ranks.any(not passes.finite)
    stats = ranks.sum_stats(passes.sums)
    if use_critic:  # over every value position of the minibatch, every rank's part included
        values = torch.cat(passes.values) if passes.values else torch.zeros(0)
        returns = torch.cat(passes.returns) if passes.returns else torch.zeros(0)
        explained = explained_variance_from_moments(ranks.sum(explained_variance_moments(values, returns)))
        if explained is not None:
            stats["value/explained_variance"] = explained
    return AccumulatedGradients(finite, stats)


def backward_micro_batches(policy: Policy, minibatch: list[TrainSequence], settings: UpdateSettings,
                           weights: MinibatchWeights) -> MicroBatchPasses:
    """This rank's micro-batches of a minibatch, forward and backward, without any exchange: a non-finite loss
    ends the pass."""
    passes = MicroBatchPasses(finite=True, sums={}, values=[], returns=[])
    # values and their returns are kept over the whole minibatch: a micro-batch may hold only a few value
    # positions, too few for a variance
    for batch in micro_batches(minibatch, settings.micro_batch_tokens, policy.tokenizer.pad_token_id, policy.device,
                               policy.shares_prefixes_with_gradients()):
        share = float(batch.response_mask.sum()) / weights.tokens  # of the minibatch's token statistics
        with blamed_on(batch):  # out of memory names the episode of its longest sequence
            part = micro_batch_loss(policy, batch, settings, weights)
            if part.values is not None:
                passes.values.append(part.values)
                passes.returns.append(part.returns)
            if not torch.isfinite(part.loss):
                passes.finite = False
                break
            if part.loss.requires_grad:
                part.loss.backward()
        for key, value in part.terms.items():
            passes.sums[key] = passes.sums.get(key, 0.0) + value
        for key, value in part.means.items():
            passes.sums[key] = passes.sums.get(key, 0.0) + value * share
    return passes


def step_optimizer(optimizer: torch.optim.Optimizer, gradients: AccumulatedGradients, cfg: PPOConfig,
                   state: UpdateState, task_ids: list[int], ranks: Ranks) -> dict[str, float]:
    """Sum the gradients over the ranks, clip them and step. A non-finite loss or gradient skips the step
    (`TooManySkips` after `max_consecutive_skips` in a row); an approx KL past `kl_stop` holds the policy
    where it is and says so with `update/kl_stopped`."""
    grad_norm, finite = float("nan"), gradients.finite
    if finite:
        ranks.sum_gradients(p for group in optimizer.param_groups for p in group["params"])
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)) if params else 0.0
        finite = math.isfinite(grad_norm)
    if not finite:
        optimizer.zero_grad(set_to_none=True)
        _count_a_skip(state, cfg, task_ids)
        return {"update/skipped": 1.0}
    if cfg.kl_stop is not None and gradients.stats.get("policy/approx_kl_k3", 0.0) > cfg.kl_stop:
        # the policy already moved too far from the one that sampled this data: keep it where it is
        optimizer.zero_grad(set_to_none=True)
        return gradients.stats | {"update/kl_stopped": 1.0, "update/skipped": 0.0}
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    state.consecutive_skips = 0
    state.optimizer_steps += 1
    return gradients.stats | {"update/grad_norm": grad_norm, "update/skipped": 0.0}


def _count_a_skip(state: UpdateState, cfg: PPOConfig, task_ids: list[int]) -> None:
    state.skipped_updates += 1
    state.consecutive_skips += 1
    log.warning("non-finite loss or gradient: update skipped (%d in a row; tasks %s)", state.consecutive_skips,
                task_ids[:16])
    if state.consecutive_skips >= cfg.max_consecutive_skips:
        raise TooManySkips(
            f"{state.consecutive_skips} consecutive updates had a non-finite loss or gradient; stopping. "
            "The last good checkpoint is intact: lower ppo.learning_rate or check the rewards, then --resume."
        )


@torch.no_grad()
def update_signal(policy: Policy, sequences: list[TrainSequence], settings: UpdateSettings,
                  ranks: Ranks = ONE_PROCESS) -> dict[str, float]:
    """Did the update push each reply the way its advantage says? Re-scores the batch (this rank's share)
    and relates every reply's advantage (the mean over its tokens) to the change of its log-probability
    (summed over its tokens) since the rollout: a healthy update has a clearly positive correlation."""
    mine = ranks.agree_on_memory(lambda: _advantages_and_changes(policy, sequences, settings))
    pairs = [pair for part in ranks.gather(mine) for pair in part]
    advantage, change = torch.tensor([a for a, _ in pairs]), torch.tensor([c for _, c in pairs])
    positive, negative = advantage > 0, advantage < 0
    return {
        "signal/advantage_logprob_corr": pearson_correlation(advantage, change),
        "signal/logprob_change_positive": float(change[positive].mean()) if positive.any() else 0.0,
        "signal/logprob_change_negative": float(change[negative].mean()) if negative.any() else 0.0,
    }


@torch.no_grad()
def _advantages_and_changes(policy: Policy, sequences: list[TrainSequence], settings: UpdateSettings
                            ) -> list[tuple[float, float]]:
    """(mean advantage, summed log-prob change since the rollout) of every reply of this rank's sequences."""
    pairs = []
    with policy.evaluating():
        for batch in micro_batches(sequences, settings.micro_batch_tokens, policy.tokenizer.pad_token_id,
                                   policy.device):
            mask = batch.response_mask.bool()
            new = policy.score(batch.input_ids, None, batch.response_mask, tree=batch.tree, with_values=False,
                               temperature=settings.temperature).logprobs
            for row, sequence in enumerate(batch.sequences):
                change = new[row][mask[row]].cpu() - sequence.old_logprobs
                pairs += [(float(sequence.advantages[span].mean()), float(change[span].sum()))
                          for span in sequence.span_slices()]
    return pairs
