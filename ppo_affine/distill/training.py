"""Training toward DISTILL-V2's score on published cells: the score's own gradient, one rollout's graph at a time.

A cell's score S = sum_i softmax(-c / tau)_i a_i (`ppo.softmax_advantage_score`) depends on the model only through
the rollouts' per-token NLLs c_i. So a cell trains in two passes and never has to fit one micro-batch: the c's
without gradients, g_i = dS/dc_i from them, then each rollout's backward of g_i * c_i on its own, which sums to
the gradient of S through the whole cell (tau included).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ppo_affine.distill.cells import Cell
from ppo_affine.distill.render import MAX_SEQ_LEN, Rendered, render_rollout
from ppo_affine.distill.score import advantages
from ppo_affine.ppo import softmax_advantage_gradient

# keeps tau off 0 where a cell's NLLs tie (e.g. two identical rollouts), so a tie still gets a ranking gradient
TAU_FLOOR = 1e-3


@dataclass(frozen=True)
class CellsStep:
    score: float  # the mean cell score before the step (what the env would report, mask and truncation alike)
    cells: int
    cells_without_signal: int  # every advantage 0 (one rollout, equal rewards): nothing to rank
    loss_tokens: int


def nll_per_token(policy, rendered: Rendered) -> torch.Tensor:
    """The rollout's mean NLL over its loss tokens (the first token, which nothing predicts, left out), a scalar
    with the policy's graph when gradients are on."""
    ids = torch.tensor([rendered.input_ids], device=policy.device)
    mask = torch.tensor([rendered.loss_mask], device=policy.device)
    mask[:, 0] = 0
    logprobs = policy.score(ids, None, mask, with_values=False).logprobs  # [1, T], 0 off the mask
    return -logprobs.sum() / mask.sum().clamp(min=1)


def accumulate_cell_gradients(policy, cells: Sequence[Cell], weight: float = 1.0, mask_reasoning: bool = True,
                              max_seq_len: int = MAX_SEQ_LEN, tau_floor: float = TAU_FLOOR) -> CellsStep:
    """Adds the gradient of -weight * (mean cell score) to the policy's parameters (the caller steps the optimizer).

    `weight` is the share of the step's loss DISTILL-V2 takes beside PPO's (1 when cells train alone). Both passes
    must compute the same function: dropout off (PPO's `ppo.disable_dropout`) or the policy in eval mode."""
    if policy.training and any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in policy.modules()):
        raise ValueError("DISTILL-V2 cells train with dropout off: the two passes must see the same model "
                         "(set ppo.disable_dropout, or call this under policy.evaluating())")
    scores, silent, loss_tokens = [], 0, 0
    for cell in cells:
        cell_advantages = torch.tensor(advantages([r.reward for r in cell.rollouts]), dtype=torch.float64)
        rendered = [render_rollout(r.messages, policy.tokenizer, mask_reasoning, max_seq_len) for r in cell.rollouts]
        loss_tokens += sum(sum(r.loss_mask) for r in rendered)
        with torch.no_grad():
            nll = torch.stack([nll_per_token(policy, r) for r in rendered])
        # the env's own score of this cell (tau unfloored), then the gradient the step follows
        scores.append(softmax_advantage_gradient(nll, cell_advantages)[0])
        if not cell_advantages.any():
            silent += 1
            continue
        _, gradient = softmax_advantage_gradient(nll, cell_advantages, tau_floor)
        for one, g in zip(rendered, gradient.tolist()):
            if g != 0.0:
                (-weight * g / len(cells) * nll_per_token(policy, one)).backward()
    mean = sum(scores) / len(scores) if scores else 0.0
    return CellsStep(score=mean, cells=len(cells), cells_without_signal=silent, loss_tokens=loss_tokens)
