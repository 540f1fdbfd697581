"""DISTILL-V2's arithmetic, as the env computes it: no model, no I/O.

Per cell: each rollout's advantage is its reward's z-score within the cell (population std; 0 for every rollout
when fewer than two rewards or the std is 0; 0 for a rollout without a reward). The model's per-token NLL of a
rollout's loss tokens, c_i = Σ -log p / n (n at least 1), becomes a preference p = softmax(-c / τ) with τ the
population std of the c's (uniform when τ is 0), and the cell scores Σ p_i a_i: within [min a, max a], 0 for a
model with no preference. Over cells: the mean with a 95 % t interval.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Sequence

import torch

from ppo_affine.ppo import softmax_advantage_preference
from ppo_affine.report import mean_interval


def advantages(rewards: Sequence[float | None]) -> list[float]:
    """Within-cell reward z-scores."""
    scored = [float(r) for r in rewards if r is not None]
    if len(scored) < 2:
        return [0.0] * len(rewards)
    mean, std = statistics.fmean(scored), statistics.pstdev(scored)
    if std == 0:
        return [0.0] * len(rewards)
    return [0.0 if r is None else (float(r) - mean) / std for r in rewards]


def loss_nll(token_logprobs: Sequence[float | None], loss_mask: Sequence[int]) -> tuple[float, int]:
    """(Σ -log p, count) over the loss positions. A position without a log-prob (the first token: nothing predicts
    it) is left out of both, as the env leaves out the server's null there."""
    total, count = 0.0, 0
    for logprob, loss in zip(token_logprobs, loss_mask):
        if loss == 1 and logprob is not None:
            total -= float(logprob)
            count += 1
    return total, count


@dataclass(frozen=True)
class CellScore:
    score: float  # Σ p_i a_i
    win_rate: float  # the preference mass on rollouts with a > 0
    preference: list[float]  # p, in rollout order


def softmax_advantage(nll_sums: Sequence[float], token_counts: Sequence[int],
                      cell_advantages: Sequence[float]) -> CellScore:
    if not nll_sums:
        return CellScore(0.0, 0.0, [])
    per_token = [total / max(count, 1) for total, count in zip(nll_sums, token_counts)]
    preference = softmax_advantage_preference(torch.tensor(per_token, dtype=torch.float64)).tolist()
    score = sum(p * a for p, a in zip(preference, cell_advantages))
    win_rate = sum(p for p, a in zip(preference, cell_advantages) if a > 0.0)
    return CellScore(score=score, win_rate=win_rate, preference=preference)


def mean_over_cells(scores: Sequence[float]) -> tuple[float | None, list[float] | None]:
    """The mean cell score and its 95 % t interval (none for fewer than two cells)."""
    return mean_interval(list(scores))
