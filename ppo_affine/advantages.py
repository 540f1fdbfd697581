"""Advantages: from scored sequences and their episodes' rewards to advantages, returns and loss weights.

Credit assignment (`ppo.credit`):
- `turn` (default): one value per turn, read at the turn's first reply token (the state is the
  prompt). A turn's reward is its env step reward (and the final score at the last turn) minus
  beta x the KL summed over its tokens; GAE(gamma, lambda) runs over turns, and the turn's
  advantage is spread over all of its tokens. So a 200-token reply costs the outcome nothing on
  its way back to earlier turns (token-level lambda 0.95 would leave 0.95^200 ~ 3e-5 of it).
- `token`: the textbook token-level GAE over the episode's reply tokens in order (gamma and lambda
  per token, a value at every reply token); right for short replies, cheap to keep.
- `group` advantages (no critic) ignore both: the episode's normalised return on every token.

Loss weights (`ppo.loss_weighting`): `token` (every token counts once), `episode` (each episode's
tokens share one unit, so a 60-turn game does not outweigh a 2-turn one), `game` (each game in the
batch shares one unit).

The sequences come scored (`experience.score_sequences`: old and reference log-probs, values); this
module needs no policy, only tensors, and writes its results into the sequences.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ppo_affine.batching import TrainSequence
from ppo_affine.config import PPOConfig
from ppo_affine.ppo import compute_gae, group_advantages, kl_penalty, masked_whiten
from ppo_affine.rollout import Episode


def final_reward(episode: Episode, cfg: PPOConfig) -> float:
    score = episode.score
    credit = episode.info.get("line_credit") if episode.env_kind == "trace" else None
    if cfg.reward.trace_line_credit and credit is not None and score < 1.0:  # partial credit below exact match
        score = cfg.reward.trace_line_credit * float(credit)
    return score - 0.5 if cfg.reward.center_score else score


def turn_rewards(episode: Episode, cfg: PPOConfig) -> list[float]:
    """Reward earned at the end of each turn (env step reward and illegal-move penalty), final score excluded."""
    return [
        (turn.reward if cfg.reward.use_env_step_rewards else 0.0)
        - (cfg.reward.illegal_move_penalty if turn.parse_error else 0.0)
        for turn in episode.turns
    ]


@dataclass
class _TurnRef:
    sequence: TrainSequence
    span: slice  # the turn's slice of the sequence's per-reply-token tensors
    turn: int


def _episode_turns(sequences: list[TrainSequence]) -> dict[int, list[_TurnRef]]:
    """Per episode, its trained turns in order, each pointing at its tokens."""
    turns: dict[int, list[_TurnRef]] = {}
    for sequence in sequences:
        for span, turn in zip(sequence.span_slices(), sequence.turns):
            turns.setdefault(sequence.episode, []).append(_TurnRef(sequence, span, turn))
    for refs in turns.values():
        refs.sort(key=lambda ref: ref.turn)
    return turns


@dataclass
class EpisodeTensors:
    """This rank's trained turns laid out by episode, one row each: [E, T] tensors hold one column per reply
    token in order across the episode's turns, [E, N] tensors one column per turn."""
    episode_ids: list[int]  # the batch index of each row's episode
    kl: torch.Tensor  # [E, T] KL penalty to the reference per token (ppo.kl_estimator)
    token_mask: torch.Tensor  # [E, T]
    token_values: torch.Tensor  # [E, T]
    token_rewards: torch.Tensor  # [E, T] env rewards at each turn's last token, before the KL
    turn_of_token: torch.Tensor  # [E, T] the turn column of each token
    turn_mask: torch.Tensor  # [E, N]
    turn_values: torch.Tensor  # [E, N] the value at the turn's first reply token
    turn_env_rewards: torch.Tensor  # [E, N] each turn's env rewards (the final score at the last), before the KL
    episode_returns: torch.Tensor  # [E]
    turn_starts: list[tuple[int, int, int]]  # (row, column of the turn's first token, turn column)

    @classmethod
    def blank(cls, episode_ids: list[int], width: int, max_turns: int) -> EpisodeTensors:
        """All zeros, for `_lay_out` to fill."""
        rows = len(episode_ids)
        return cls(episode_ids=episode_ids, kl=torch.zeros(rows, width), token_mask=torch.zeros(rows, width),
                   token_values=torch.zeros(rows, width), token_rewards=torch.zeros(rows, width),
                   turn_of_token=torch.zeros(rows, width, dtype=torch.long), turn_mask=torch.zeros(rows, max_turns),
                   turn_values=torch.zeros(rows, max_turns), turn_env_rewards=torch.zeros(rows, max_turns),
                   episode_returns=torch.zeros(rows), turn_starts=[])


def _lay_out(by_episode: dict[int, list[_TurnRef]], episodes: list[Episode], cfg: PPOConfig) -> EpisodeTensors:
    """Rewards, KL and values of every trained turn, copied from the sequences into per-episode rows."""
    episode_ids = sorted(by_episode)
    # a rank may have no episode: one empty column keeps the shapes valid
    width = max((sum(ref.span.stop - ref.span.start for ref in by_episode[e]) for e in episode_ids), default=1)
    out = EpisodeTensors.blank(episode_ids, width, max((len(by_episode[e]) for e in episode_ids), default=1))
    for r, e in enumerate(episode_ids):
        rewards = turn_rewards(episodes[e], cfg)
        position = 0
        for k, ref in enumerate(by_episode[e]):
            out.turn_starts.append((r, position, k))
            length = ref.span.stop - ref.span.start
            columns = slice(position, position + length)
            out.kl[r, columns] = kl_penalty(ref.sequence.old_logprobs[ref.span], ref.sequence.ref_logprobs[ref.span],
                                            cfg.kl_estimator)
            out.token_values[r, columns] = ref.sequence.old_values[ref.span]
            out.token_mask[r, columns] = 1
            out.turn_of_token[r, columns] = k
            reward = rewards[ref.turn] + (final_reward(episodes[e], cfg) if k == len(by_episode[e]) - 1 else 0.0)
            out.token_rewards[r, position + length - 1] = reward
            out.turn_env_rewards[r, k] = reward
            out.turn_values[r, k] = ref.sequence.old_values[ref.span][0]
            out.turn_mask[r, k] = 1
            position += length
        out.episode_returns[r] = out.turn_env_rewards[r].sum()
    return out


# Credit assignment: each returns [E, T] advantages, returns and the mask of where a value is trained.
def _group_credit(layout: EpisodeTensors, group_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The episode's return normalised within its group, on every token; no critic."""
    groups = torch.tensor([group_ids[e] for e in layout.episode_ids])
    n, width = layout.token_mask.shape
    advantages = group_advantages(layout.episode_returns, groups)[:, None].expand(n, width) * layout.token_mask
    return advantages, torch.zeros(n, width), torch.zeros(n, width)


def _token_credit(layout: EpisodeTensors, cfg: PPOConfig, kl_coef: float
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GAE over the reply tokens in order, a value at every one."""
    rewards = layout.token_rewards - kl_coef * layout.kl * layout.token_mask
    advantages, returns = compute_gae(rewards, layout.token_values, layout.token_mask, cfg.gamma, cfg.lam)
    return advantages, returns, layout.token_mask.clone()


def _turn_credit(layout: EpisodeTensors, cfg: PPOConfig, kl_coef: float
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GAE over turns (a turn's KL summed over its tokens), the turn's advantage on each of its tokens; a turn's
    value and return sit at its first token."""
    n, width = layout.token_mask.shape
    turn_kl = torch.zeros_like(layout.turn_mask).scatter_add_(1, layout.turn_of_token, layout.kl * layout.token_mask)
    turn_advantages, turn_returns = compute_gae(layout.turn_env_rewards - kl_coef * turn_kl * layout.turn_mask,
                                                layout.turn_values, layout.turn_mask, cfg.gamma, cfg.lam)
    advantages = turn_advantages.gather(1, layout.turn_of_token) * layout.token_mask
    rows, columns, turn_columns = torch.tensor(layout.turn_starts, dtype=torch.long).reshape(-1, 3).T
    value_mask = torch.zeros(n, width)
    value_mask[rows, columns] = 1
    returns = torch.zeros(n, width)
    returns[rows, columns] = turn_returns[rows, turn_columns]
    return advantages, returns, value_mask


def _write_back(sequences: list[TrainSequence], by_episode: dict[int, list[_TurnRef]], episode_ids: list[int],
                advantages: torch.Tensor, returns: torch.Tensor, token_weights: torch.Tensor,
                value_weights: torch.Tensor) -> None:
    """The [E, T] results into each sequence's [R] fields, turn by turn (every reply token is in one turn)."""
    for sequence in sequences:
        length = sequence.response_len
        sequence.advantages, sequence.returns = torch.zeros(length), torch.zeros(length)
        sequence.token_weights, sequence.value_weights = torch.zeros(length), torch.zeros(length)
    for r, e in enumerate(episode_ids):
        position = 0
        for ref in by_episode[e]:
            columns, sequence = slice(position, position + ref.span.stop - ref.span.start), ref.sequence
            sequence.advantages[ref.span] = advantages[r, columns]
            sequence.returns[ref.span] = returns[r, columns]
            sequence.token_weights[ref.span] = token_weights[r, columns]
            sequence.value_weights[ref.span] = value_weights[r, columns]
            position = columns.stop


def _batch_statistics(layout: EpisodeTensors, advantages: torch.Tensor, valued: torch.Tensor,
                      sequences: list[TrainSequence], global_sum: Callable[[torch.Tensor], torch.Tensor]
                      ) -> dict[str, float]:
    """KL, return, advantage, value and entropy means over the whole batch: each statistic is a sum divided by
    a count, both summed over the ranks. `valued` marks the values to average."""
    token_mask, valued = layout.token_mask, valued.bool()
    entropy = torch.cat([s.entropy for s in sequences if s.entropy is not None] or [torch.zeros(0)])
    (kl_total, tokens, episode_count, returns_total, advantage_total, value_total, valued_count, entropy_total,
     entropy_count) = global_sum(torch.stack([
            (layout.kl * token_mask).double().sum(), token_mask.double().sum(),
            torch.tensor(float(len(layout.episode_ids)), dtype=torch.float64), layout.episode_returns.double().sum(),
            torch.where(token_mask.bool(), advantages, 0).double().sum(),
            torch.where(valued, layout.token_values, 0).double().sum(), valued.double().sum(), entropy.double().sum(),
            torch.tensor(float(entropy.numel()), dtype=torch.float64),
        ])).tolist()
    stats = {
        "reward/kl_per_token": kl_total / max(tokens, 1.0),
        "reward/kl_per_episode": kl_total / max(episode_count, 1.0),
        "reward/episode_return": returns_total / max(episode_count, 1.0),
        "reward/advantage_mean": advantage_total / max(tokens, 1.0),
        "value/mean": value_total / max(valued_count, 1.0),
    }
    if entropy_count:
        stats["policy/entropy"] = entropy_total / entropy_count
    return stats


def assign_advantages(sequences: list[TrainSequence], episodes: list[Episode], cfg: PPOConfig, kl_coef: float,
                      group_ids: list[int] | None,
                      global_sum: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> dict[str, float]:
    """Rewards (score, step rewards, -beta*KL), advantages, returns and loss weights, written into the sequences.

    In data-parallel training `sequences` are this rank's share of the batch's (`episodes` is the whole
    batch, indexed by `TrainSequence.episode`) and `global_sum` sums a tensor over the ranks: advantages
    are whitened, games counted and statistics averaged over the whole batch. A group stays on one rank."""
    by_episode = _episode_turns(sequences)
    layout = _lay_out(by_episode, episodes, cfg)
    if cfg.advantage == "group":
        assert group_ids is not None
        advantages, returns, value_mask = _group_credit(layout, group_ids)
    elif cfg.credit == "token":
        advantages, returns, value_mask = _token_credit(layout, cfg, kl_coef)
    else:
        advantages, returns, value_mask = _turn_credit(layout, cfg, kl_coef)
    if cfg.whiten_advantages and cfg.advantage == "gae":
        advantages = masked_whiten(advantages, layout.token_mask, global_sum=global_sum)

    games = [episodes[e].game_name for e in layout.episode_ids]
    # the whole batch's episodes of each game (those with reply tokens: every one of them has sequences)
    games_in_batch = Counter(episode.game_name for episode in episodes if episode.generated_tokens)
    _write_back(sequences, by_episode, layout.episode_ids, advantages, returns,
                _loss_weights(layout.token_mask, games, cfg.loss_weighting, games_in_batch),
                _loss_weights(value_mask, games, cfg.loss_weighting, games_in_batch))
    # group mode trains no value; its values (0 from scoring) are averaged over every token
    valued = value_mask if cfg.advantage == "gae" else layout.token_mask
    return _batch_statistics(layout, advantages, valued, sequences, global_sum)


def _loss_weights(mask: torch.Tensor, games: list[str], weighting: str,
                  games_in_batch: Counter | None = None) -> torch.Tensor:
    """[E, T] weights on `mask`: 1 per token, or each episode's (game's) tokens sharing one unit;
    `games_in_batch` counts the whole batch's episodes per game (default: these rows')."""
    if weighting == "token":
        return mask.clone()
    per_episode = mask / mask.sum(dim=1, keepdim=True).clamp(min=1)
    if weighting == "episode":
        return per_episode
    episodes_of_game = games_in_batch if games_in_batch is not None else Counter(games)
    return per_episode / torch.tensor([float(episodes_of_game[g]) for g in games])[:, None]
