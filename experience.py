"""From played episodes to training tensors: old/ref log-probs, values, rewards and advantages.

One training sample is one turn (its prompt + the exact generated token ids). Rewards and GAE
work on episode rows: an episode's generated tokens in order across its turns, so credit flows
from the final score back through every earlier turn.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from policy import Policy
from ppo import compute_gae, group_advantages, kl_penalty, masked_mean, masked_whiten
from rollout import Episode
from utils import PPOConfig


@dataclass
class TurnSample:
    episode: int  # index into the batch's episodes
    input_ids: list[int]  # prompt + response
    prompt_len: int
    old_logprobs: torch.Tensor  # [R]
    ref_logprobs: torch.Tensor  # [R]
    old_values: torch.Tensor  # [R]
    sampler_logprobs: list[float] | None = None
    advantages: torch.Tensor | None = None  # [R]
    returns: torch.Tensor | None = None  # [R]

    @property
    def response_len(self) -> int:
        return len(self.input_ids) - self.prompt_len


def pack_by_tokens(lengths: list[int], budget: int) -> list[list[int]]:
    """Group sample indices (in the given order) so that rows x longest row <= budget per group."""
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for index, length in zip(range(len(lengths)), lengths):
        grown = max(longest, length)
        if current and grown * (len(current) + 1) > budget:
            groups.append(current)
            current, longest = [], 0
            grown = length
        current.append(index)
        longest = grown
    if current:
        groups.append(current)
    return groups


def collate(samples: list[TurnSample], pad_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Right-padded [B, T] tensors; per-response-token fields are placed at their token positions."""
    width = max(len(s.input_ids) for s in samples)
    batch = {
        "input_ids": torch.full((len(samples), width), pad_id, dtype=torch.long),
        "attention_mask": torch.zeros((len(samples), width), dtype=torch.long),
        "response_mask": torch.zeros((len(samples), width), dtype=torch.float32),
    }
    per_token = ("old_logprobs", "ref_logprobs", "old_values", "advantages", "returns")
    for name in per_token:
        batch[name] = torch.zeros((len(samples), width), dtype=torch.float32)
    for row, sample in enumerate(samples):
        n, p = len(sample.input_ids), sample.prompt_len
        batch["input_ids"][row, :n] = torch.tensor(sample.input_ids)
        batch["attention_mask"][row, :n] = 1
        batch["response_mask"][row, p:n] = 1
        for name in per_token:
            value = getattr(sample, name)
            if value is not None:
                batch[name][row, p:n] = value
    return {k: v.to(device) for k, v in batch.items()}


@torch.no_grad()
def score_turns(policy: Policy, episodes: list[Episode], token_budget: int, temperature: float,
                with_values: bool) -> list[TurnSample]:
    """Recompute log-probs with the training model (policy and reference) and values, per turn."""
    samples = [
        TurnSample(episode=e, input_ids=turn.prompt_ids + turn.response_ids, prompt_len=len(turn.prompt_ids),
                   old_logprobs=None, ref_logprobs=None, old_values=None,  # type: ignore[arg-type]
                   sampler_logprobs=turn.sampler_logprobs)
        for e, episode in enumerate(episodes) for turn in episode.turns if turn.response_ids
    ]
    pad_id = policy.tokenizer.pad_token_id
    was_training = policy.training
    policy.eval()
    try:
        order = sorted(range(len(samples)), key=lambda i: len(samples[i].input_ids))
        for group in pack_by_tokens([len(samples[i].input_ids) for i in order], token_budget):
            chunk = [samples[order[i]] for i in group]
            batch = collate(chunk, pad_id, policy.device)
            scored = policy.score(batch["input_ids"], batch["attention_mask"], batch["response_mask"],
                                  with_values=with_values, temperature=temperature)
            with policy.reference():
                ref = policy.score(batch["input_ids"], batch["attention_mask"], batch["response_mask"],
                                   with_values=False, temperature=temperature)
            for row, sample in enumerate(chunk):
                span = slice(sample.prompt_len, len(sample.input_ids))
                sample.old_logprobs = scored.logprobs[row, span].cpu()
                sample.ref_logprobs = ref.logprobs[row, span].cpu()
                sample.old_values = (scored.values[row, span].cpu() if scored.values is not None
                                     else torch.zeros(sample.response_len))
    finally:
        policy.train(was_training)
    return samples


def final_reward(episode: Episode, cfg: PPOConfig) -> float:
    return episode.score - 0.5 if cfg.reward.center_score else episode.score


def turn_rewards(episode: Episode, cfg: PPOConfig) -> list[float]:
    """Reward earned at the end of each turn (env step reward and illegal-move penalty), final score excluded."""
    return [
        (turn.reward if cfg.reward.use_env_step_rewards else 0.0)
        - (cfg.reward.illegal_move_penalty if turn.parse_error else 0.0)
        for turn in episode.turns if turn.response_ids
    ]


def assign_advantages(samples: list[TurnSample], episodes: list[Episode], cfg: PPOConfig, kl_coef: float,
                      group_ids: list[int] | None) -> dict[str, float]:
    """Per-token rewards (score, step rewards, -beta*KL), then GAE or group advantages, written into samples."""
    rows: dict[int, list[TurnSample]] = {}
    for sample in samples:
        rows.setdefault(sample.episode, []).append(sample)
    episode_ids = sorted(rows)
    width = max(sum(s.response_len for s in rows[e]) for e in episode_ids)
    n = len(episode_ids)
    rewards = torch.zeros(n, width)  # [E, T]
    values = torch.zeros(n, width)
    kl = torch.zeros(n, width)
    mask = torch.zeros(n, width)
    episode_returns = torch.zeros(n)
    for r, e in enumerate(episode_ids):
        position = 0
        step_rewards = turn_rewards(episodes[e], cfg)
        for sample, step_reward in zip(rows[e], step_rewards):
            span = slice(position, position + sample.response_len)
            kl[r, span] = kl_penalty(sample.old_logprobs, sample.ref_logprobs, cfg.kl_estimator)
            values[r, span] = sample.old_values
            mask[r, span] = 1
            position += sample.response_len
            rewards[r, position - 1] += step_reward
        rewards[r, position - 1] += final_reward(episodes[e], cfg)
        episode_returns[r] = rewards[r].sum()

    if cfg.advantage == "gae":
        token_rewards = rewards - kl_coef * kl * mask
        advantages, returns = compute_gae(token_rewards, values, mask, cfg.gamma, cfg.lam)
        if cfg.whiten_advantages:
            advantages = masked_whiten(advantages, mask)
    else:
        assert group_ids is not None
        by_episode = torch.tensor([group_ids[e] for e in episode_ids])
        advantages = group_advantages(episode_returns, by_episode)[:, None].expand(n, width) * mask
        returns = episode_returns[:, None].expand(n, width) * mask

    for r, e in enumerate(episode_ids):
        position = 0
        for sample in rows[e]:
            span = slice(position, position + sample.response_len)
            sample.advantages = advantages[r, span].clone()
            sample.returns = returns[r, span].clone()
            position += sample.response_len

    episode_kl = (kl * mask).sum(dim=1)
    return {
        "reward/kl_per_episode": float(episode_kl.mean()),
        "reward/kl_per_token": float(masked_mean(kl, mask)),
        "reward/episode_return": float(episode_returns.mean()),
        "reward/token_reward_mean": float(masked_mean(rewards - kl_coef * kl * mask, mask)),
        "reward/advantage_mean": float(masked_mean(advantages, mask)),
        "value/mean": float(masked_mean(values, mask)),
    }


def sampler_gap(samples: list[TurnSample]) -> float | None:
    """Mean |trainer - sampler| log-prob on the sampled tokens; large values mean the server runs other weights."""
    gaps = [abs(float(o) - s) for sample in samples if sample.sampler_logprobs
            for o, s in zip(sample.old_logprobs, sample.sampler_logprobs) if not math.isnan(s)]
    return sum(gaps) / len(gaps) if gaps else None
