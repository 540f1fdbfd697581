"""The PPO update: epochs over shuffled minibatches of turns, micro-batches packed by a token budget."""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch

from experience import TurnSample, collate, pack_by_tokens
from policy import Policy
from ppo import explained_variance, kl_penalty, masked_mean, policy_loss, value_loss
from utils import PPOConfig

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


def build_optimizer(policy: Policy, cfg: PPOConfig, value_lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        [
            {"params": policy.adapter_parameters(), "lr": cfg.learning_rate, "name": "adapter"},
            {"params": list(policy.value_head.parameters()), "lr": value_lr, "name": "value_head"},
        ],
        weight_decay=0.0,
    )


def ppo_update(
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    samples: list[TurnSample],
    cfg: PPOConfig,
    kl_coef: float,
    temperature: float,
    generator: torch.Generator,
    state: UpdateState,
    value_only: bool = False,
    task_ids: list[int] | None = None,
) -> dict[str, float]:
    """`ppo_epochs` passes; returns the mean of each logged statistic over optimizer steps."""
    use_critic = cfg.advantage == "gae"
    pad_id = policy.tokenizer.pad_token_id
    stats: dict[str, list[float]] = {}
    early_stop = False
    policy.train()
    for epoch in range(cfg.ppo_epochs):
        order = torch.randperm(len(samples), generator=generator).tolist()
        minibatches = [order[i :: cfg.num_minibatches] for i in range(cfg.num_minibatches)]
        epoch_kl = []
        for minibatch in minibatches:
            if not minibatch:
                continue
            step_stats = _optimizer_step(policy, optimizer, [samples[i] for i in minibatch], cfg, kl_coef,
                                         temperature, pad_id, use_critic, value_only, state, task_ids)
            for key, value in step_stats.items():
                stats.setdefault(key, []).append(value)
            if "policy/approx_kl_k3" in step_stats:
                epoch_kl.append(step_stats["policy/approx_kl_k3"])
            if cfg.kl_stop is not None and epoch_kl and sum(epoch_kl) / len(epoch_kl) > cfg.kl_stop:
                early_stop = True
                break
        if early_stop:
            break
    summary = {key: sum(values) / len(values) for key, values in stats.items() if values}
    summary["update/epochs_run"] = float(epoch + 1)
    summary["update/early_stopped"] = float(early_stop)
    summary["update/skipped_total"] = float(state.skipped_updates)
    return summary


def _optimizer_step(policy, optimizer, minibatch, cfg, kl_coef, temperature, pad_id, use_critic, value_only,
                    state: UpdateState, task_ids) -> dict[str, float]:
    total_tokens = sum(s.response_len for s in minibatch)
    minibatch = sorted(minibatch, key=lambda s: len(s.input_ids))
    optimizer.zero_grad(set_to_none=True)
    sums: dict[str, float] = {}
    finite = True
    for group in pack_by_tokens([len(s.input_ids) for s in minibatch], cfg.micro_batch_tokens):
        chunk = [minibatch[i] for i in group]
        batch = collate(chunk, pad_id, policy.device)
        mask = batch["response_mask"]
        weight = float(mask.sum()) / total_tokens  # micro-batch share of the minibatch's token mean
        scored = policy.score(batch["input_ids"], batch["attention_mask"], mask, with_values=use_critic,
                              with_entropy=True, temperature=temperature)
        loss = torch.zeros((), device=policy.device)
        parts: dict[str, float] = {}
        if not value_only:
            pg_loss, pg_stats = policy_loss(scored.logprobs, batch["old_logprobs"], batch["advantages"], mask,
                                            cfg.cliprange)
            loss = loss + pg_loss - cfg.entropy_coef * scored.entropy
            parts["policy/loss"] = pg_loss.item()
            parts.update({f"policy/{k}": float(v) for k, v in pg_stats.items()})
            if not use_critic and kl_coef > 0:  # group mode keeps the reference close through the loss
                kl_loss = masked_mean(kl_penalty(scored.logprobs, batch["ref_logprobs"], "k3"), mask)
                loss = loss + kl_coef * kl_loss
                parts["policy/kl_loss"] = kl_loss.item()
        if use_critic:
            vf_loss, vf_stats = value_loss(scored.values, batch["old_values"], batch["returns"], mask,
                                           cfg.cliprange_value)
            loss = loss + cfg.vf_coef * vf_loss
            parts["value/loss"] = vf_loss.item()
            parts.update({f"value/{k}": float(v) for k, v in vf_stats.items()})
            parts["value/explained_variance"] = float(explained_variance(scored.values.detach(), batch["returns"], mask))
        parts["policy/entropy"] = scored.entropy.item()
        if not torch.isfinite(loss):
            finite = False
            break
        (loss * weight).backward()
        for key, value in parts.items():
            sums[key] = sums.get(key, 0.0) + value * weight

    grad_norm = float("nan")
    if finite:
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)) if params else 0.0
        finite = math.isfinite(grad_norm)
    if not finite:
        optimizer.zero_grad(set_to_none=True)
        state.skipped_updates += 1
        state.consecutive_skips += 1
        log.warning("non-finite loss or gradient: update skipped (%d in a row; tasks %s)",
                    state.consecutive_skips, (task_ids or [])[:16])
        if state.consecutive_skips >= cfg.max_consecutive_skips:
            raise TooManySkips(
                f"{state.consecutive_skips} consecutive updates had a non-finite loss or gradient; stopping. "
                "The last good checkpoint is intact: lower ppo.learning_rate or check the rewards, then --resume."
            )
        return {"update/skipped": 1.0}
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    state.consecutive_skips = 0
    state.optimizer_steps += 1
    sums["update/grad_norm"] = grad_norm
    sums["update/skipped"] = 0.0
    return sums
