"""Score DISTILL-V2 cells with a model: render each rollout, teacher-force it, apply the env's arithmetic.

Two ways to get the log-probs, one pipeline after them:
- `score_cells(cells, policy)`: the trainer's own model in this process, through `Policy.score` (the trainer's
  token-scoring path, which computes the vocabulary only at the loss tokens). The policy scores as it stands: an
  adapter active scores the adapter, `with policy.base():` the base.
- `score_cells_through_server(cells, tokenizer, url, model)`: a vLLM (or SGLang) server, the env's own request:
  the ids as the prompt to /v1/completions with echo and logprobs, one generated token that is never counted.

Both return a `DistillScore`: per cell (keyed by the cell's task index, the env's task_id), the mean over cells and
its 95 % interval.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

from ppo_affine.distill.cells import Cell
from ppo_affine.distill.render import MAX_SEQ_LEN, Rendered, render_rollout
from ppo_affine.distill.score import advantages, loss_nll, mean_over_cells, softmax_advantage
from ppo_affine.generation import VLLMError

# ids -> the log-prob of each token given the ones before it (None where nothing was computed: the first token)
TokenLogprobs = Callable[[Rendered], list[float | None]]


@dataclass(frozen=True)
class RolloutResult:
    rollout_id: str
    reward: float | None
    advantage: float
    nll_sum: float
    loss_tokens: int
    preference: float


@dataclass(frozen=True)
class CellResult:
    task_idx: int
    env_name: str
    task_id: int
    teacher_name: str
    score: float
    win_rate: float
    harness_dropped: int
    rollouts: list[RolloutResult]


@dataclass(frozen=True)
class DistillScore:
    cells: dict[int, CellResult]  # by task index
    mean: float | None
    ci95: list[float] | None
    settings: dict = field(default_factory=dict)

    def summary(self) -> dict:
        """For summary.json: the mean, its interval and every cell (its rollouts' numbers included)."""
        return {"score": self.mean, "score_ci95": self.ci95, "cells": len(self.cells), **self.settings,
                "per_cell": {str(k): asdict(v) for k, v in self.cells.items()}}


def score_cell(cell: Cell, tokenizer, logprobs_of: TokenLogprobs, mask_reasoning: bool = True,
               max_seq_len: int = MAX_SEQ_LEN) -> CellResult:
    cell_advantages = advantages([r.reward for r in cell.rollouts])
    sums, counts = [], []
    for rollout in cell.rollouts:
        rendered = render_rollout(rollout.messages, tokenizer, mask_reasoning, max_seq_len)
        total, count = loss_nll(logprobs_of(rendered), rendered.loss_mask)
        sums.append(total)
        counts.append(count)
    verdict = softmax_advantage(sums, counts, cell_advantages)
    rollouts = [RolloutResult(r.rollout_id, r.reward, a, s, n, p) for r, a, s, n, p in
                zip(cell.rollouts, cell_advantages, sums, counts, verdict.preference)]
    return CellResult(cell.task_idx, cell.env_name, cell.task_id, cell.teacher_name, verdict.score,
                      verdict.win_rate, cell.harness_dropped, rollouts)


def score_with(cells: Sequence[Cell], tokenizer, logprobs_of: TokenLogprobs, mask_reasoning: bool = True,
               max_seq_len: int = MAX_SEQ_LEN, on_cell: Callable[[CellResult], None] | None = None) -> DistillScore:
    results = {}
    for cell in cells:
        results[cell.task_idx] = score_cell(cell, tokenizer, logprobs_of, mask_reasoning, max_seq_len)
        if on_cell:
            on_cell(results[cell.task_idx])
    mean, ci95 = mean_over_cells([r.score for r in results.values()])
    return DistillScore(results, mean, ci95, {"mask_reasoning": mask_reasoning, "max_seq_len": max_seq_len})


# ---------------------------------------------------------------------- the trainer's model, in process
def policy_logprobs(policy) -> TokenLogprobs:
    """Teacher forcing with the trainer's Policy: log-probs at the loss tokens (0 elsewhere, None at the first)."""
    import torch

    def logprobs_of(rendered: Rendered) -> list[float | None]:
        ids = torch.tensor([rendered.input_ids], device=policy.device)
        mask = torch.tensor([rendered.loss_mask], device=policy.device)
        with torch.no_grad(), policy.evaluating():
            scored = policy.score(ids, None, mask, with_values=False)
        values: list[float | None] = scored.logprobs[0].tolist()
        values[0] = None  # nothing predicts the first token; the server reports null there too
        return values

    return logprobs_of


def score_cells(cells: Sequence[Cell], policy, mask_reasoning: bool = True, max_seq_len: int = MAX_SEQ_LEN,
                on_cell: Callable[[CellResult], None] | None = None) -> DistillScore:
    """The DISTILL-V2 score of `policy` (the trainer's Policy, as it stands) on `cells`."""
    return score_with(cells, policy.tokenizer, policy_logprobs(policy), mask_reasoning, max_seq_len, on_cell)


# ---------------------------------------------------------------------- a server, as the env asks it
def server_logprobs(url: str, model: str, api_key: str | None = None, timeout_s: float = 600.0) -> TokenLogprobs:
    """Teacher forcing through an OpenAI-compatible server's /v1/completions: `url` ends in /v1."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def logprobs_of(rendered: Rendered) -> list[float | None]:
        # max_tokens and logprobs 1, not 0: SGLang refuses 0 for either; the generated token lies past the prompt
        payload = {"model": model, "prompt": rendered.input_ids, "max_tokens": 1, "echo": True, "logprobs": 1,
                   "temperature": 0}
        try:
            response = httpx.post(f"{url.rstrip('/')}/completions", json=payload, headers=headers, timeout=timeout_s)
            response.raise_for_status()
        except httpx.HTTPError as exc:
            detail = exc.response.text[:300] if isinstance(exc, httpx.HTTPStatusError) else str(exc)
            raise VLLMError(f"teacher forcing {len(rendered.input_ids)} tokens at {url} failed ({type(exc).__name__}: "
                            f"{detail}); a DISTILL-V2 rendering can be as long as max_seq_len, which the server's "
                            "--max-model-len must hold") from None
        return response.json()["choices"][0]["logprobs"]["token_logprobs"][:len(rendered.input_ids)]

    return logprobs_of


def score_cells_through_server(cells: Sequence[Cell], tokenizer, url: str, model: str, api_key: str | None = None,
                               mask_reasoning: bool = True, max_seq_len: int = MAX_SEQ_LEN,
                               on_cell: Callable[[CellResult], None] | None = None) -> DistillScore:
    """The DISTILL-V2 score of the model `model` served at `url`, rendered with `tokenizer` (the served model's)."""
    return score_with(cells, tokenizer, server_logprobs(url, model, api_key), mask_reasoning, max_seq_len, on_cell)
