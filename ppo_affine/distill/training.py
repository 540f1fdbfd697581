"""Training toward DISTILL-V2's score on published cells: the score's own gradient, one rollout's graph at a time.

A cell's score S = sum_i softmax(-c / tau)_i a_i (`ppo.softmax_advantage_score`) depends on the model only through
the rollouts' per-token NLLs c_i. So a cell trains in two passes and never has to fit one micro-batch: the c's
without gradients, g_i = dS/dc_i from them, then each rollout's backward of g_i * c_i on its own, which sums to
the gradient of S through the whole cell (tau included). An optional KL anchor (k2, 0.5 (log p - log p_ref)^2 per
loss token: the tokens are the teacher's, not the policy's samples, so the penalty must hold for any token) keeps
the policy near its reference on the same tokens.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ppo_affine.distill.cells import Cell, read_cells_for
from ppo_affine.distill.evaluation import score_cells
from ppo_affine.distill.render import MAX_SEQ_LEN, Rendered, render_rollout
from ppo_affine.distill.score import advantages
from ppo_affine.ppo import kl_penalty, softmax_advantage_gradient, softmax_advantage_score
from ppo_affine.seeds import restore_random

# keeps tau off 0 where a cell's NLLs tie (e.g. two identical rollouts), so a tie still gets a ranking gradient
TAU_FLOOR = 1e-3


@dataclass(frozen=True)
class CellsStep:
    score: float  # the mean cell score before the step (what the env would report, mask and truncation alike)
    cells: int
    cells_without_signal: int  # every advantage 0 (one rollout, equal rewards): nothing to rank
    loss_tokens: int
    kl_per_token: float  # k2 to the reference over the loss tokens, before the step (0 without the anchor)


def loss_token_logprobs(policy, rendered: Rendered) -> torch.Tensor:
    """Log-probs of the rollout's loss tokens ([n], the first token, which nothing predicts, left out), with the
    policy's graph when gradients are on."""
    ids = torch.tensor([rendered.input_ids], device=policy.device)
    mask = torch.tensor([rendered.loss_mask], device=policy.device)
    mask[:, 0] = 0
    logprobs = policy.score(ids, None, mask, with_values=False).logprobs  # [1, T], 0 off the mask
    return logprobs[mask.bool()]


def nll_per_token(policy, rendered: Rendered) -> torch.Tensor:
    """The rollout's mean NLL over its loss tokens (the env's c_i), a scalar."""
    logprobs = loss_token_logprobs(policy, rendered)
    return -logprobs.sum() / max(logprobs.numel(), 1)


def accumulate_cell_gradients(policy, cells: Sequence[Cell], weight: float = 1.0, kl_coef: float = 0.0,
                              mask_reasoning: bool = True, max_seq_len: int = MAX_SEQ_LEN,
                              tau_floor: float = TAU_FLOOR) -> CellsStep:
    """Adds the gradient of -weight * (mean cell score) + kl_coef * (mean k2 per loss token) to the policy's
    parameters; the caller steps the optimizer.

    `weight` is the share of the step's loss DISTILL-V2 takes beside PPO's (1 when cells train alone). Both passes
    must compute the same function: dropout off (PPO's `ppo.disable_dropout`) or the policy in eval mode."""
    if policy.training and any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in policy.modules()):
        raise ValueError("DISTILL-V2 cells train with dropout off: the two passes must see the same model "
                         "(set ppo.disable_dropout, or call this under policy.evaluating())")
    scores, silent, loss_tokens, kl_sum = [], 0, 0, 0.0
    for cell in cells:
        cell_advantages = torch.tensor(advantages([r.reward for r in cell.rollouts]), dtype=torch.float64)
        rendered = [render_rollout(r.messages, policy.tokenizer, mask_reasoning, max_seq_len) for r in cell.rollouts]
        with torch.no_grad():
            first_pass = [loss_token_logprobs(policy, r) for r in rendered]
            reference = None
            if kl_coef > 0:
                with policy.reference():
                    reference = [loss_token_logprobs(policy, r) for r in rendered]
                kl_sum += sum(kl_penalty(p, q, "k2").sum().item() for p, q in zip(first_pass, reference))
        loss_tokens += sum(p.numel() for p in first_pass)
        nll = torch.stack([-p.sum() / max(p.numel(), 1) for p in first_pass])
        scores.append(softmax_advantage_score(nll, cell_advantages).item())  # the env's own score: tau unfloored
        gradient = softmax_advantage_gradient(nll, cell_advantages, tau_floor)[1]
        if not cell_advantages.any():
            silent += 1
            gradient = torch.zeros_like(gradient)
        for i, one in enumerate(rendered):
            g = gradient[i].item()
            if g == 0.0 and reference is None:
                continue
            logprobs = loss_token_logprobs(policy, one)
            count = max(logprobs.numel(), 1)
            loss = -weight * g * (-logprobs.sum() / count)
            if reference is not None:  # each rollout's mean per token, averaged over the cell's rollouts
                loss = loss + kl_coef * kl_penalty(logprobs, reference[i], "k2").sum() / count / len(rendered)
            (loss / len(cells)).backward()
    mean = sum(scores) / len(scores) if scores else 0.0
    return CellsStep(score=mean, cells=len(cells), cells_without_signal=silent, loss_tokens=loss_tokens,
                     kl_per_token=kl_sum / max(loss_tokens, 1))


class CellTraining:
    """The cells a run trains on and scores: a seeded draw of `cells_per_step` training cells a step (its state goes
    into the checkpoint), one optimizer step on them, and the score of the held-out cells."""

    def __init__(self, settings, seed: int):
        self.settings = settings  # config.DistillConfig
        self.train_cells = self._read("distill.cells", settings.cells)
        self.held_out_cells = self._read("distill.held_out_cells", settings.held_out_cells) \
            if settings.held_out_cells else []
        self.draws = random.Random(seed)

    def _read(self, field: str, source: str) -> list[Cell]:
        return read_cells_for(field, source, self.settings.cache_dir)

    def step(self, policy, optimizer, max_grad_norm: float, anchor=None) -> dict[str, float]:
        """One optimizer step on this step's cells; metrics under distill/. `anchor` (an AnchorTraining) adds its
        term to the same step, so AdamW weighs the two gradients by their sizes."""
        chosen = self.draws.sample(self.train_cells, min(self.settings.cells_per_step, len(self.train_cells)))
        trainable = [p for group in optimizer.param_groups for p in group["params"]]
        optimizer.zero_grad(set_to_none=True)
        result = accumulate_cell_gradients(policy, chosen, self.settings.weight, self.settings.kl_coef,
                                           self.settings.mask_reasoning, self.settings.max_seq_len)
        anchored = anchor.accumulate(policy) if anchor is not None else {}
        grad_norm = torch.nn.utils.clip_grad_norm_(trainable, max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return {"distill/score": result.score, "distill/cells": result.cells,
                "distill/cells_without_signal": result.cells_without_signal,
                "distill/loss_tokens": result.loss_tokens, "distill/kl_per_token": result.kl_per_token,
                "distill/grad_norm": float(grad_norm), **anchored}

    def held_out_metrics(self, policy) -> dict[str, float]:
        """The held-out cells' DISTILL-V2 score (the env's arithmetic) and its interval, when there are any."""
        if not self.held_out_cells:
            return {}
        with torch.no_grad(), policy.evaluating():
            result = score_cells(self.held_out_cells, policy, self.settings.mask_reasoning, self.settings.max_seq_len)
        metrics = {"distill/held_out_score": result.mean if result.mean is not None else 0.0}
        if result.ci95:
            metrics["distill/held_out_ci95_low"], metrics["distill/held_out_ci95_high"] = result.ci95
        return metrics

    def state_dict(self) -> dict[str, Any]:
        return {"draws": self.draws.getstate()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        restore_random(self.draws, state["draws"])
