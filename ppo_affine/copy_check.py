"""The validators' copy check: would the candidate pass for a copy of the champion.

Mirrors affine-cortex (commit c2d7ec8, 2026-07-24) `affine/src/anticopy/` in our own code:
- a rollout is one of the champion's conversations, rendered with the chat template (no generation prompt) and
  tokenised; its *assistant tokens* are those inside a ChatML `<|im_start|>assistant\\n ... <|im_end|>` body
  (`refresh.py`), the sequence cut from the front to 30 000 tokens;
- each model teacher-forces the rollout; its log-probs at the assistant tokens, in order, are indexed 0, 1, ...;
  its *decision positions* are those where its log-prob is below -0.5 (`pairwise.py`);
- per rollout, over the union of both models' decision positions, |log-prob difference|, a side that did not
  flag a position counting as log-prob 0 there (the validators keep only decision positions);
- every rollout's differences pooled into one bag: its median below 0.05 marks a copy, given at least 50
  positions; fewer is "too few positions" (no verdict).
The statistic is pure (log-prob lists in); `assistant_tokens` and `teacher_forced_logprobs` are the two steps that
need a tokenizer and a model.
"""
from __future__ import annotations

import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from ppo_affine.config import ValidatorRuleConfig

MAX_ROLLOUT_TOKENS = 30_000  # refresh.py's serving budget: longer rollouts lose their beginning
ASSISTANT_BODY = re.compile(r"<\|im_start\|>assistant\n(.*?)<\|im_end\|>", re.DOTALL)
COPY, NOT_A_COPY, TOO_FEW = "copy", "not a copy", "too few positions"


@dataclass(frozen=True)
class CopyStatistic:
    median: float | None  # pooled median |Δ log-prob| over the decision positions; None when there are none
    positions: int  # decision positions (union per rollout, summed over rollouts)
    rollouts: int  # rollouts that gave at least one position
    per_env: dict[str, tuple[float, int]]  # env -> (median, positions), for reading, not for the verdict
    verdict: str  # COPY | NOT_A_COPY | TOO_FEW
    threshold: float
    min_positions: int

    @property
    def line(self) -> str:
        median = "none" if self.median is None else f"{self.median:.4f}"
        return (f"copy check: median |Δ log-prob| {median} over {self.positions} decision positions "
                f"({self.rollouts} rollouts); a copy below {self.threshold:g} with at least {self.min_positions} "
                f"positions: {self.verdict}")


def decision_gaps(candidate: Sequence[float], champion: Sequence[float], cutoff: float) -> list[float]:
    """|Δ log-prob| over the union of both sides' decision positions of one rollout; a side's value at a position
    it did not flag counts as 0."""
    flagged_candidate = {i: lp for i, lp in enumerate(candidate) if lp < cutoff}
    flagged_champion = {i: lp for i, lp in enumerate(champion) if lp < cutoff}
    union = sorted(flagged_candidate.keys() | flagged_champion.keys())
    return [abs(flagged_candidate.get(i, 0.0) - flagged_champion.get(i, 0.0)) for i in union]


def copy_statistic(candidate: dict[str, Sequence[float]], champion: dict[str, Sequence[float]],
                   env_of: dict[str, str], rule: ValidatorRuleConfig) -> CopyStatistic:
    """The statistic over the rollouts both models scored; each maps a rollout key to its assistant-token
    log-probs, `env_of` the key to its env."""
    pooled: list[float] = []
    by_env: dict[str, list[float]] = {}
    rollouts = 0
    for key in candidate.keys() & champion.keys():
        gaps = decision_gaps(candidate[key], champion[key], rule.copy_decision_logprob)
        if gaps:
            rollouts += 1
            pooled += gaps
            by_env.setdefault(env_of.get(key, "?"), []).extend(gaps)
    median = statistics.median(pooled) if pooled else None
    if len(pooled) < rule.copy_min_positions:
        verdict = TOO_FEW
    else:
        verdict = COPY if median < rule.copy_threshold else NOT_A_COPY
    return CopyStatistic(median, len(pooled), rollouts,
                         {env: (statistics.median(gaps), len(gaps)) for env, gaps in sorted(by_env.items())},
                         verdict, rule.copy_threshold, rule.copy_min_positions)


def assistant_tokens(tokenizer, messages: list[dict], chat_template_kwargs: dict | None = None
                     ) -> tuple[list[int], list[bool]]:
    """A conversation's token ids and which of them are assistant tokens, the way the validators build a rollout:
    the rendered text tokenised with offsets, a token marked when it overlaps an assistant message's ChatML body.
    A template that is not ChatML marks nothing (the validators skip such a rollout)."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False,
                                         **(chat_template_kwargs or {}))
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    bodies = [match.span(1) for match in ASSISTANT_BODY.finditer(text)]
    mask = [any(start < body_end and end > body_start for body_start, body_end in bodies)
            for start, end in encoded["offset_mapping"]]
    ids = list(encoded["input_ids"])
    cut = max(0, len(ids) - MAX_ROLLOUT_TOKENS)
    return ids[cut:], mask[cut:]


def teacher_forced_logprobs(policy, token_ids: list[int], assistant_mask: list[bool]) -> list[float]:
    """The policy's log-prob of each assistant token given everything before it, in order (one forward pass)."""
    import torch

    input_ids = torch.tensor([token_ids], device=policy.device)  # [1, T]
    mask = torch.tensor([assistant_mask], device=policy.device)  # [1, T]
    mask[:, 0] = False  # nothing predicts the first token (the validators' server returns no log-prob there)
    with torch.no_grad(), policy.evaluating():
        scored = policy.score(input_ids, None, mask, with_values=False)
    return scored.logprobs[mask].tolist()
