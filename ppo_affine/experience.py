"""From played episodes to training tensors: old/ref log-probs, values, rewards, advantages, weights.

The unit of scoring and update is a `TrainSequence`: one token sequence of an episode with every
turn it holds (prompt and observation tokens masked, each reply's tokens trained). When the chat
template renders the conversation append-only (`prompts.TokenHistory`), a whole episode is one
sequence and every token is processed once; otherwise a turn starts a new sequence.

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
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ppo_affine.policy import Policy, common_prefix_length
from ppo_affine.prefixes import padded_cost, partition
from ppo_affine.ppo import compute_gae, group_advantages, kl_penalty, masked_whiten, truncated_importance_weights
from ppo_affine.rollout import Episode
from ppo_affine.config import PPOConfig


@dataclass
class TrainSequence:
    episode: int  # index into the batch's episodes
    input_ids: list[int]
    spans: list[tuple[int, int]]  # [start, end) of each turn's reply tokens, in turn order
    turns: list[int]  # the episode's turn index of each span
    sampler_logprobs: list[float] | None = None
    # Per reply token, the spans concatenated in order: [R]
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    old_values: torch.Tensor | None = None
    entropy: torch.Tensor | None = None  # of the rollout policy, for logging
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    token_weights: torch.Tensor | None = None  # policy-loss weight of each reply token
    importance_weights: torch.Tensor | None = None  # min(pi_trainer_old / pi_sampler, C) (ppo.sampler_correction)
    value_weights: torch.Tensor | None = None  # value-loss weight; 0 where no value is trained

    @property
    def response_len(self) -> int:
        return sum(end - start for start, end in self.spans)

    def span_slices(self) -> list[slice]:
        """Each turn's slice of the per-reply-token tensors."""
        slices, position = [], 0
        for start, end in self.spans:
            slices.append(slice(position, position + end - start))
            position += end - start
        return slices


def build_sequences(episodes: list[Episode]) -> list[TrainSequence]:
    """Every episode's token sequences that hold at least one reply token."""
    sequences = []
    for e, episode in enumerate(episodes):
        by_sequence: dict[int, list[int]] = {}
        for t, turn in enumerate(episode.turns):
            if turn.response_ids:
                by_sequence.setdefault(turn.sequence, []).append(t)
        for s, turn_indices in sorted(by_sequence.items()):
            turns = [episode.turns[t] for t in turn_indices]
            spans = [(turn.start, turn.start + len(turn.response_ids)) for turn in turns]
            sampler = None
            if all(turn.sampler_logprobs is not None for turn in turns):
                sampler = [lp for turn in turns for lp in turn.sampler_logprobs]
            sequences.append(TrainSequence(episode=e, input_ids=episode.sequences[s][: spans[-1][1]], spans=spans,
                                           turns=turn_indices, sampler_logprobs=sampler))
    return sequences


def plan_micro_batches(token_ids: list[list[int]], budget: int, share_prefixes: bool = True) -> list[list[int]]:
    """Indices grouped into micro-batches that each put at most `budget` tokens through the model (right
    padding included; a sequence longer than the budget gets a micro-batch of its own).

    With `share_prefixes` (the policy runs a micro-batch's common prefix once, see `Policy.score`) the
    sequences that begin alike, such as one game's rules or a group's episodes of one task and seed,
    go together, and the split is the one that processes the fewest tokens (`prefixes.partition`).
    Without, sequences sorted by length fill micro-batches up to rows x longest <= budget."""
    if share_prefixes:
        def cost(rows: int, shared: int, longest: int) -> int | None:
            tokens = padded_cost(rows, shared, longest)
            return tokens if tokens <= budget else None

        return [rows for rows, _ in partition(token_ids, cost)]
    groups: list[list[int]] = []
    current: list[int] = []
    for index in sorted(range(len(token_ids)), key=lambda i: len(token_ids[i])):
        # sorted ascending: the newest member is the longest
        if current and len(token_ids[index]) * (len(current) + 1) > budget:
            groups.append(current)
            current = []
        current.append(index)
    if current:
        groups.append(current)
    return groups


def batch_cost(input_ids: torch.Tensor) -> int:
    """Tokens a [B, T] right-padded micro-batch puts through the model (a shared prefix counted once)."""
    rows, width = input_ids.shape
    return padded_cost(rows, common_prefix_length(input_ids), width)


def collate(sequences: list[TrainSequence], pad_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Right-padded [B, T] tensors; per-reply-token fields are placed at their token positions.
    Right padding needs no attention mask: causal attention never looks at the padding after a row."""
    width = max(len(s.input_ids) for s in sequences)
    batch = {
        "input_ids": torch.full((len(sequences), width), pad_id, dtype=torch.long),
        "response_mask": torch.zeros((len(sequences), width), dtype=torch.float32),
    }
    per_token = ("old_logprobs", "ref_logprobs", "old_values", "advantages", "returns", "token_weights",
                 "value_weights", "importance_weights")
    for name in per_token:
        batch[name] = torch.zeros((len(sequences), width), dtype=torch.float32)
    for row, sequence in enumerate(sequences):
        batch["input_ids"][row, : len(sequence.input_ids)] = torch.tensor(sequence.input_ids)
        positions = torch.cat([torch.arange(start, end) for start, end in sequence.spans])
        batch["response_mask"][row, positions] = 1
        for name in per_token:
            value = getattr(sequence, name)
            if value is not None:
                batch[name][row, positions] = value
    return {k: v.to(device) for k, v in batch.items()}


@torch.no_grad()
def score_sequences(policy: Policy, sequences: list[TrainSequence], token_budget: int, temperature: float,
                    with_values: bool) -> dict[str, float]:
    """Old and reference log-probs, values and the rollout policy's entropy of every reply token,
    by the training model; returns token counts (padding included) of this pass."""
    pad_id = policy.tokenizer.pad_token_id
    was_training = policy.training
    policy.eval()
    processed = 0
    try:
        for group in plan_micro_batches([s.input_ids for s in sequences], token_budget):
            chunk = [sequences[i] for i in group]
            batch = collate(chunk, pad_id, policy.device)
            processed += batch_cost(batch["input_ids"])
            mask = batch["response_mask"].bool()
            scored = policy.score(batch["input_ids"], None, batch["response_mask"], with_values=with_values,
                                  with_entropy=True, temperature=temperature)
            with policy.reference():
                ref = policy.score(batch["input_ids"], None, batch["response_mask"], with_values=False,
                                   temperature=temperature)
            for row, sequence in enumerate(chunk):
                sequence.old_logprobs = scored.logprobs[row][mask[row]].cpu()
                sequence.ref_logprobs = ref.logprobs[row][mask[row]].cpu()
                sequence.entropy = scored.entropy[row][mask[row]].cpu()
                sequence.old_values = (scored.values[row][mask[row]].cpu() if scored.values is not None
                                       else torch.zeros(sequence.response_len))
    finally:
        policy.train(was_training)
    unique = sum(len(s.input_ids) for s in sequences)
    # processed < unique where micro-batches share prefixes, > unique where rows are padded
    return {"perf/tokens_processed": float(processed), "perf/unique_tokens": float(unique),
            "perf/processed_over_unique": processed / unique if unique else 0.0}


def final_reward(episode: Episode, cfg: PPOConfig) -> float:
    return episode.score - 0.5 if cfg.reward.center_score else episode.score


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
    def zeros(cls, episode_ids: list[int], width: int, max_turns: int) -> EpisodeTensors:
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
    out = EpisodeTensors.zeros(episode_ids, width, max((len(by_episode[e]) for e in episode_ids), default=1))
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


def _write_back(by_episode: dict[int, list[_TurnRef]], episode_ids: list[int],
                per_token: dict[str, torch.Tensor]) -> None:
    """Each [E, T] tensor of `per_token` into the sequence field of its name, turn by turn."""
    for r, e in enumerate(episode_ids):
        position = 0
        for ref in by_episode[e]:
            length = ref.span.stop - ref.span.start
            for name, source in per_token.items():
                if getattr(ref.sequence, name) is None:
                    setattr(ref.sequence, name, torch.zeros(ref.sequence.response_len))
                getattr(ref.sequence, name)[ref.span] = source[r, position : position + length]
            position += length


def _batch_statistics(layout: EpisodeTensors, advantages: torch.Tensor, valued: torch.Tensor,
                      sequences: list[TrainSequence], global_sum: Callable[[torch.Tensor], torch.Tensor]
                      ) -> dict[str, float]:
    """KL, return, advantage, value and entropy means over the whole batch: each statistic is a sum divided by
    a count, both summed over the ranks. `valued` marks the values to average."""
    token_mask, valued = layout.token_mask, valued.bool()
    entropy = torch.cat([s.entropy for s in sequences if s.entropy is not None] or [torch.zeros(0)])
    kl_total, tokens, episode_count, returns_total, advantage_total, value_total, valued_count, entropy_total, \
        entropy_count = global_sum(torch.stack([
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
    _write_back(by_episode, layout.episode_ids, {
        "advantages": advantages,
        "returns": returns,
        "token_weights": _loss_weights(layout.token_mask, games, cfg.loss_weighting, games_in_batch),
        "value_weights": _loss_weights(value_mask, games, cfg.loss_weighting, games_in_batch),
    })
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


def sampler_gap(sequences: list[TrainSequence],
                global_sum: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> float | None:
    """Mean |trainer - sampler| log-prob on the sampled tokens (over every rank's with `global_sum`); large
    values mean a server runs other weights."""
    gaps = [abs(float(o) - s) for sequence in sequences if sequence.sampler_logprobs
            for o, s in zip(sequence.old_logprobs, sequence.sampler_logprobs) if not math.isnan(s)]
    total, count = global_sum(torch.tensor([sum(gaps), len(gaps)], dtype=torch.float64)).tolist()
    return total / count if count else None


def correct_for_the_sampler(sequences: list[TrainSequence], cap: float,
                            global_sum: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> dict[str, float]:
    """Truncated importance weights min(pi_trainer_old / pi_sampler, cap) on every reply token (1 where the trainer
    sampled it: local generation), and their mean and the fraction the cap bit over the tokens another process
    sampled (over every rank's with `global_sum`); no statistics when there are none."""
    weight_sum, capped, count = 0.0, 0.0, 0.0
    for sequence in sequences:
        if sequence.sampler_logprobs is None:
            sequence.importance_weights = torch.ones(sequence.response_len)
            continue
        sampler = torch.tensor(sequence.sampler_logprobs, dtype=sequence.old_logprobs.dtype)
        sequence.importance_weights, bit = truncated_importance_weights(sequence.old_logprobs, sampler, cap)
        known = ~torch.isnan(sampler)
        weight_sum += float(sequence.importance_weights[known].sum())
        capped += float(bit.sum())
        count += float(known.sum())
    weight_sum, capped, count = global_sum(torch.tensor([weight_sum, capped, count], dtype=torch.float64)).tolist()
    if not count:
        return {}
    return {"tis/weight_mean": weight_sum / count, "tis/clip_fraction": capped / count}
