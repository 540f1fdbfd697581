"""The one interface every environment backend offers, so the training loop never knows which it has.

Calls are async and OpenEnv-shaped, like the Affine envs served by affinetes:
reset/step/state return a `StepResult` dict with exactly the six OpenEnv fields.

`info` keys the trainer reads (backends add their own on top):
- `system_prompt`: the system message for the conversation, or None (no system message).
- `turn_prompt`: the user prompt of the decision now pending (state, legal actions), without
  any feedback text; the `last` context strategy builds its messages from it.
- `parse_error`: True when the action just sent could not be used (unparseable or illegal).
- `score` (float in [0, 1]) and `success` (bool) once `done` is True.
- `error`: a dict `{type, message, retryable}` when something went wrong.
"""
from __future__ import annotations

from typing import Any, Protocol, TypedDict


class EpisodeLost(Exception):
    """A server the episode depends on (an env server, a vLLM server) went away or restarted and lost
    it; the rollout replays the episode from its start with the same task and seed. `outage`: the
    server had been down and was waited for (such replays do not use up the episode's replay budget)."""

    def __init__(self, message: str, outage: bool):
        super().__init__(message)
        self.outage = outage


class StepResult(TypedDict):
    observation: str
    reward: float
    done: bool
    truncated: bool
    episode_id: str | None
    info: dict[str, Any]


def step_result(
    observation: str,
    reward: float = 0.0,
    done: bool = False,
    truncated: bool = False,
    episode_id: str | None = None,
    info: dict[str, Any] | None = None,
) -> StepResult:
    """Build a StepResult with plain JSON-serialisable types."""
    return StepResult(
        observation=str(observation),
        reward=float(reward),
        done=bool(done),
        truncated=bool(truncated),
        episode_id=episode_id,
        info=dict(info or {}),
    )


class Env(Protocol):
    """What every backend (embedded game/trace env, affinetes docker/url) implements."""

    async def reset(self, task_id: int | None = None, seed: int | None = None, **kwargs: Any) -> StepResult: ...

    async def step(self, action: str, episode_id: str) -> StepResult: ...

    async def state(self, episode_id: str) -> StepResult: ...

    async def stop(self, episode_id: str) -> dict[str, Any]: ...

    async def close(self) -> None: ...
