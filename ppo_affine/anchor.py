"""An anchor for the envs a run does not train: a KL term on a fixed set of the reference model's own episodes.

The episodes are recorded once, before training, by the model the run starts from (evaluate.py's episodes.jsonl,
e.g. `python evaluate.py --base-only --games liars_dice --temperature 1 --output-dir DIR`). Each step draws
`per_step` of each anchored env's episodes, renders them as DISTILL-V2 renders a rollout (the replies are the loss
tokens) and adds, per anchored env, coef * (mean over its loss tokens of r - 1 - log r), r = p_policy / p_ref.

Why that estimator: the tokens are the reference's samples, so r - 1 - log r is an unbiased estimate of
KL(reference || policy) at each position, never negative, and its gradient (r - 1) d log p is zero for every token
while the policy has not moved; a plain NLL term has the same gradient in expectation but pushes each drawn
episode's tokens up even at the start, noise the anchor would add at every step.

Why in the same optimizer step as the loss it holds back (the cells' step; `accumulate`): AdamW scales each step by
the running size of the gradients, so an anchor stepping alone would move the weights by about the learning rate
whatever its coef. With PPO alone the anchor takes a step of its own after the update (`step`): PPO's update is
several clipped minibatch steps, and one anchor forward a training step costs `per_step` episodes, not that many
times over.
"""
from __future__ import annotations

import json
import math
import random
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from ppo_affine.distill.cells import Message, ToolCall
from ppo_affine.distill.render import MAX_SEQ_LEN, Rendered, render_rollout
from ppo_affine.distill.training import loss_token_logprobs
from ppo_affine.ppo import kl_penalty
from ppo_affine.seeds import restore_random


@dataclass(frozen=True)
class AnchorEpisode:
    env: str  # the metric's name: the record's game (`trace` for trace tasks), else its env
    where: str  # file:line, for messages
    messages: tuple[Message, ...]


def _message(raw: dict[str, Any]) -> Message:
    """A recorded conversation message (OpenAI chat format, as evaluate.py stores it) as DISTILL-V2's Message."""
    calls = []
    for call in raw.get("tool_calls") or []:
        function = call.get("function", call)
        arguments = function.get("arguments") or {}
        calls.append(ToolCall(id=str(call.get("id", "")), name=function["name"],
                              arguments=json.loads(arguments) if isinstance(arguments, str) else arguments))
    return Message(role=raw["role"], content=raw.get("content"),
                   reasoning=raw.get("reasoning") or raw.get("reasoning_content"), tool_calls=calls,
                   tool_call_id=raw.get("tool_call_id"))


def read_anchor_episodes(field: str, path: str | Path) -> list[AnchorEpisode]:
    """Every episode of one episodes.jsonl that has a reply to anchor; anything unreadable is a ConfigError line
    naming the field, the file and the line."""
    from ppo_affine.config import ConfigError

    path = Path(path).expanduser()
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"{field}: cannot read {path} ({exc.strerror or exc}); record the episodes first, e.g. "
                          "python evaluate.py --base-only --games GAME --temperature 1 --output-dir DIR") from None
    episodes = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
            messages = tuple(_message(m) for m in record["conversation"])
            env = str(record.get("game") or record["env"])
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"{field}: {where} is not a recorded episode (evaluate.py's episodes.jsonl: "
                              f"'conversation' and 'game' or 'env'): {type(exc).__name__}: {exc}") from None
        if any(m.role == "assistant" and (m.content or m.tool_calls) for m in messages):
            episodes.append(AnchorEpisode(env, where, messages))
    if not episodes:
        raise ConfigError(f"{field}: {path} holds no episode with a reply to anchor on")
    return episodes


def split_held_out(episodes: Sequence[AnchorEpisode], share: float
                   ) -> tuple[dict[str, list[AnchorEpisode]], dict[str, list[AnchorEpisode]]]:
    """(anchored, held out) by env: of each env's episodes, in file order, the last ceil(share * n) are held out."""
    by_env: dict[str, list[AnchorEpisode]] = defaultdict(list)
    for episode in episodes:
        by_env[episode.env].append(episode)
    anchored, held_out = {}, {}
    for env, mine in by_env.items():
        cut = len(mine) - math.ceil(share * len(mine))
        anchored[env], held_out[env] = mine[:cut], mine[cut:]
    return anchored, held_out


def anchor_kl(logprobs: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Per token r - 1 - log r, r = p_policy / p_ref: KL(reference || policy) estimated on the reference's samples
    (PPO's k3 with the two models' places swapped)."""
    return kl_penalty(reference, logprobs, "k3")


def loss_tokens(rendered: Rendered) -> int:
    """The tokens `loss_token_logprobs` returns: the masked ones, the first (which nothing predicts) left out."""
    return sum(rendered.loss_mask[1:])


class AnchorTraining:
    """The anchored envs' episodes (read, and split into anchored and held-out, before the model loads), the seeded
    draws of each step (their state goes into the checkpoint) and the reference's log-probs, computed once."""

    def __init__(self, settings, seed: int):
        from ppo_affine.config import ConfigError

        self.settings = settings  # config.AnchorConfig
        episodes = [e for path in settings.episodes for e in read_anchor_episodes("anchor.episodes", path)]
        self.anchored, self.held_out = split_held_out(episodes, settings.held_out_share)
        for env, mine in self.anchored.items():
            if not mine:
                raise ConfigError(f"anchor.held_out_share={settings.held_out_share} holds out every one of env "
                                  f"{env}'s {len(self.held_out[env])} episodes: nothing is left to anchor on")
        self.draws = random.Random(seed)
        self._rendered: dict[str, Rendered] = {}  # by AnchorEpisode.where
        self._reference: dict[str, torch.Tensor] = {}

    def _prepared(self, policy, episode: AnchorEpisode) -> tuple[Rendered, torch.Tensor]:
        """The episode's rendering and the reference's log-probs at its loss tokens (the set is fixed, so once)."""
        if episode.where not in self._rendered:
            rendered = render_rollout(episode.messages, policy.tokenizer, True, MAX_SEQ_LEN)
            with torch.no_grad(), policy.evaluating(), policy.reference():
                self._reference[episode.where] = loss_token_logprobs(policy, rendered).detach()
            self._rendered[episode.where] = rendered
        return self._rendered[episode.where], self._reference[episode.where]

    def accumulate(self, policy) -> dict[str, float]:
        """Adds the gradient of coef * (per anchored env, the mean anchor KL per token over this step's episodes)
        to the parameters; the caller steps the optimizer. Metrics: each env's KL before the step."""
        metrics = {}
        for env in sorted(self.anchored):
            chosen = self.draws.sample(self.anchored[env], min(self.settings.per_step, len(self.anchored[env])))
            prepared = [self._prepared(policy, episode) for episode in chosen]
            tokens = max(sum(loss_tokens(rendered) for rendered, _ in prepared), 1)
            total = 0.0
            for rendered, reference in prepared:
                kl = anchor_kl(loss_token_logprobs(policy, rendered), reference).sum()
                (self.settings.coef * kl / tokens).backward()
                total += kl.item()
            metrics[f"anchor/{env}/kl"] = total / tokens
            metrics[f"anchor/{env}/tokens"] = tokens
        return metrics

    def step(self, policy, optimizer, max_grad_norm: float) -> dict[str, float]:
        """An optimizer step on the anchor alone (after a PPO update when no cells train)."""
        trainable = [p for group in optimizer.param_groups for p in group["params"]]
        optimizer.zero_grad(set_to_none=True)
        metrics = self.accumulate(policy)
        metrics["anchor/grad_norm"] = float(torch.nn.utils.clip_grad_norm_(trainable, max_grad_norm))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return metrics

    def held_out_metrics(self, policy) -> dict[str, float]:
        """Each env's anchor KL over its held-out episodes (never drawn), pooled per token."""
        metrics = {}
        with torch.no_grad():
            for env in sorted(self.held_out):
                if not self.held_out[env]:
                    continue
                total, tokens = 0.0, 0
                for episode in self.held_out[env]:
                    rendered, reference = self._prepared(policy, episode)
                    with policy.evaluating():
                        total += anchor_kl(loss_token_logprobs(policy, rendered), reference).sum().item()
                    tokens += loss_tokens(rendered)
                metrics[f"anchor/{env}/held_out_kl"] = total / max(tokens, 1)
        return metrics

    def state_dict(self) -> dict[str, Any]:
        return {"draws": self.draws.getstate()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        restore_random(self.draws, state["draws"])
