"""The curriculum's configuration: task sources, stages with their promotion rule, the failure buffer.

`curriculum.py` at the root samples from it; `ppo_affine.config.Config` holds one as its `curriculum` section.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ppo_affine.envs.tasks import AVAILABLE_GAMES, GAME_ID_STRIDE, TRACE_LEVELS, players_of

VALIDATOR_GAMES = ["goofspiel", "liars_dice", "leduc_poker", "gin_rummy"]

Opponent = Literal["random", "mcts"]


class TaskSource(BaseModel):
    """Where a stage draws task ids from: games, explicit id ranges, or trace difficulty levels."""

    model_config = ConfigDict(extra="forbid")

    env: str = Field(min_length=1, description="Name of an environment in env_config (e.g. 'openspiel', 'trace').")
    weight: float = Field(1.0, gt=0, allow_inf_nan=False, description="Relative sampling weight within the stage.")
    games: list[str] | None = Field(
        None, min_length=1, description="Game names from envs.tasks.AVAILABLE_GAMES, drawn uniformly."
    )
    config_ids: list[int] | None = Field(
        None,
        min_length=1,
        description=f"With games: parameter variants to draw from; None = uniform in [0, {GAME_ID_STRIDE}).",
    )
    task_id_ranges: list[tuple[int, int]] | None = Field(
        None, min_length=1, description="Half-open [lo, hi) task-id ranges, drawn uniformly over their union."
    )
    trace_difficulty: list[int] | None = Field(
        None, min_length=1, description=f"Trace difficulty levels from {TRACE_LEVELS}, drawn uniformly."
    )
    opponent: Opponent | None = Field(None, description="Overrides the stage's opponent for this source.")
    seat: Literal[0, 1] | None = Field(
        None,
        description="With games: the model's seat (0 = moves first) in every episode. Seeds are drawn with "
        "seed mod the game's players = seat, which puts the model there in both the openenv (seed mod players) "
        "and the evaluate ((seed mod 2) mod players) conversation. None = any seat.",
    )

    @field_validator("games")
    @classmethod
    def _known_games(cls, games: list[str] | None) -> list[str] | None:
        unknown = [g for g in games or [] if g not in AVAILABLE_GAMES]
        if unknown:
            raise ValueError(f"unknown games {unknown}; expected names from {AVAILABLE_GAMES}")
        return games

    @field_validator("config_ids")
    @classmethod
    def _config_ids_in_range(cls, config_ids: list[int] | None) -> list[int] | None:
        bad = [c for c in config_ids or [] if not 0 <= c < GAME_ID_STRIDE]
        if bad:
            raise ValueError(f"config ids {bad} are outside [0, {GAME_ID_STRIDE})")
        return config_ids

    @field_validator("task_id_ranges")
    @classmethod
    def _ranges_ordered(cls, ranges: list[tuple[int, int]] | None) -> list[tuple[int, int]] | None:
        bad = [list(r) for r in ranges or [] if not 0 <= r[0] < r[1]]
        if bad:
            raise ValueError(f"ranges {bad} are not half-open [lo, hi) with 0 <= lo < hi")
        return ranges

    @field_validator("trace_difficulty")
    @classmethod
    def _known_levels(cls, levels: list[int] | None) -> list[int] | None:
        bad = [level for level in levels or [] if level not in TRACE_LEVELS]
        if bad:
            raise ValueError(f"trace difficulty levels {bad} are not in {TRACE_LEVELS}")
        return levels

    @model_validator(mode="after")
    def _exactly_one_kind(self) -> "TaskSource":
        given = [name for name in ("games", "task_id_ranges", "trace_difficulty") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(
                "a task source sets exactly one of 'games', 'task_id_ranges', 'trace_difficulty'; "
                f"got {given or 'none'}"
            )
        if self.config_ids is not None and self.games is None:
            raise ValueError("'config_ids' only applies together with 'games'")
        if self.seat is not None:
            if self.games is None:
                raise ValueError("'seat' only applies together with 'games'")
            too_few = [g for g in self.games if self.seat >= players_of(g)]
            if too_few:
                raise ValueError(f"seat {self.seat} does not exist in {too_few} (seats are 0 .. players - 1)")
        if self.opponent is not None and self.trace_difficulty is not None:
            raise ValueError("'opponent' does not apply to a 'trace_difficulty' source (trace tasks have none)")
        return self


class Stage(BaseModel):
    """One curriculum stage: its task mix, opponent and promotion rule."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, description="Unique stage name (used in logs and checkpoints).")
    tasks: list[TaskSource] = Field(min_length=1, description="Task sources, mixed by weight.")
    opponent: Opponent = Field("random", description="Game opponent unless a source overrides it.")
    success_threshold: float = Field(
        0.6, gt=0, le=1, description="Promote when the rolling success metric reaches this value."
    )
    min_episodes: int = Field(100, ge=1, description="Episodes of this stage needed before promotion.")
    review: float = Field(
        0.0,
        ge=0,
        lt=1,
        allow_inf_nan=False,
        description="Share of this stage's fresh tasks drawn from the stages before it (one of them uniformly, then "
        "its sources by weight), so a promotion does not stop the training on what they taught. Those episodes "
        "count for their own stage's totals, never for this stage's promotion. 0 on the first stage.",
    )


class FailureBufferConfig(BaseModel):
    """Replay of failed tasks (same task id, seed and opponent), prioritised by 1 - score."""

    model_config = ConfigDict(extra="forbid")

    capacity: int = Field(1000, ge=1, description="Most failed tasks kept; the lowest priority is evicted.")
    replay_prob: float = Field(0.3, ge=0, le=1, description="Chance that a sampled task is a replay.")
    mastery: int = Field(3, ge=1, description="Successful replays after which a task retires from the buffer.")


def _default_stages() -> list[Stage]:
    games = list(VALIDATOR_GAMES)
    return [
        # config_id 0 = the smallest variant of each game
        Stage(name="easy", tasks=[TaskSource(env="openspiel", games=games, config_ids=[0])], opponent="random"),
        Stage(name="medium", tasks=[TaskSource(env="openspiel", games=games)], opponent="random"),
        # the validators' distribution: task ids uniform in [0, 4 * GAME_ID_STRIDE), MCTS opponent
        Stage(name="hard", tasks=[TaskSource(env="openspiel", games=games)], opponent="mcts"),
    ]


class CurriculumConfig(BaseModel):
    """Stages in order, the promotion window, and the failure buffer."""

    model_config = ConfigDict(extra="forbid")

    stages: list[Stage] = Field(
        default_factory=_default_stages, min_length=1, description="Stages in order; the last one is never left."
    )
    window: int = Field(100, ge=1, description="Rolling window (episodes) of the success metric.")
    failure_buffer: FailureBufferConfig = Field(default_factory=FailureBufferConfig, description="Failure replay.")
    success_metric: Literal["success", "score"] = Field(
        "success", description="Rolling mean of success flags or of scores, compared with the threshold."
    )

    @field_validator("stages")
    @classmethod
    def _unique_names(cls, stages: list[Stage]) -> list[Stage]:
        names = [stage.name for stage in stages]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"stage names must be unique; repeated: {duplicates}")
        if stages[0].review > 0:
            raise ValueError(f"stage {stages[0].name!r} is the first: 'review' draws from the stages before it, "
                             "and there are none (set it to 0)")
        return stages

    @property
    def meets_search_opponent(self) -> bool:
        """Whether some game task source plays the MCTS opponent."""
        return any((source.opponent or stage.opponent) == "mcts" for stage in self.stages for source in stage.tasks
                   if source.trace_difficulty is None)


def default_curriculum() -> CurriculumConfig:
    """easy (validator games, smallest variants, random) -> medium (all variants) -> hard (vs MCTS)."""
    return CurriculumConfig()
