"""Curriculum: stages of weighted task sources, promotion on a rolling success rate, failure replay.

Decisions the trainer relies on:
- Promotion looks only at fresh (non-replay) episodes sampled from the current stage. Replays
  are chosen because they failed, so counting them would bias the stage's success rate down;
  episodes sampled before a promotion but reported after it don't count for the new stage.
- A stage's `review` share of fresh draws comes from an earlier stage and carries that stage's
  name, so it counts in that stage's totals and never towards the current stage's promotion.
- Every failure (fresh or replay, any stage) enters the failure buffer keyed by
  (env, task_id, seed, opponent); only successful *replays* count towards retiring it.
- All randomness comes from one numpy Generator seeded from `seed`; `state_dict()` holds its
  state, so a restored curriculum samples exactly the same tasks.
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from ppo_affine.curriculum_config import CurriculumConfig, Stage, TaskSource
from ppo_affine.envs.trace_programs import repeats_a_held_out_program
from ppo_affine.envs.tasks import (GAME_ID_STRIDE, Task, game_name_of, game_task_id, players_of,
                                   trace_training_range)

SEED_LIMIT = 2**32 - 1  # seeds are drawn from [0, SEED_LIMIT)
MAX_PLAYABLE_DRAWS = 100  # task ids tried per sample before giving up on an unplayable source
STATE_VERSION = 1


@dataclass
class _FailedTask:
    task: Task  # with replay=True, returned as-is when replayed
    priority: float
    successes: int = 0


def _buffer_key(task: Task) -> tuple[str, int, int, str | None]:
    return (task.env, task.task_id, task.seed, task.opponent)


class Curriculum:
    """Samples tasks from the current stage or the failure buffer and promotes on reported results."""

    def __init__(
        self, config: CurriculumConfig, seed: int, is_playable: Callable[[str, int], bool] | None = None
    ):
        self.config = config
        self._rng = np.random.default_rng(seed)
        self._is_playable = is_playable
        self._stage_index = 0
        self._window: deque[float] = deque(maxlen=config.window)  # success metric, current stage, fresh only
        self._stage_episodes = 0  # fresh episodes of the current stage reported since it started
        self._totals = {stage.name: {"episodes": 0, "successes": 0} for stage in config.stages}
        self._buffer: dict[tuple[str, int, int, str | None], _FailedTask] = {}  # insertion order = age
        self._reported = 0
        self._replayed = 0
        self._retired = 0
        self._promotions: list[dict[str, Any]] = []

    @property
    def stage(self) -> Stage:
        return self.config.stages[self._stage_index]

    @property
    def stage_index(self) -> int:
        return self._stage_index

    @property
    def promotions(self) -> list[dict[str, Any]]:
        """One record per promotion: from_stage, to_stage, episode (total reported), stage_episodes."""
        return [dict(p) for p in self._promotions]

    # ------------------------------------------------------------------ sampling
    def sample(self, n: int) -> list[Task]:
        """`n` tasks, each a replay with probability replay_prob (if the buffer has any) or fresh."""
        return [self._draw() for _ in range(n)]

    def sample_groups(self, n_groups: int, group_size: int) -> list[Task]:
        """`n_groups` tasks, each repeated `group_size` times in a row (same task id and seed)."""
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        return [task for _ in range(n_groups) for task in [self._draw()] * group_size]

    def _draw(self) -> Task:
        if self._buffer and self._rng.random() < self.config.failure_buffer.replay_prob:
            return self._draw_replay()
        return self._draw_fresh()

    def _draw_replay(self) -> Task:
        entries = list(self._buffer.values())
        priorities = np.array([entry.priority for entry in entries], dtype=np.float64)
        total = priorities.sum()
        # failures that still scored 1.0 have priority 0; if only those remain, draw uniformly
        p = priorities / total if total > 0 else None
        return entries[int(self._rng.choice(len(entries), p=p))].task

    def _draw_fresh(self) -> Task:
        stage = self.stage
        # no random draw without review, so runs without it sample exactly the tasks they always did
        if stage.review > 0 and self._rng.random() < stage.review:
            stage = self.config.stages[int(self._rng.integers(self._stage_index))]
        weights = np.array([source.weight for source in stage.tasks], dtype=np.float64)
        source_index = int(self._rng.choice(len(stage.tasks), p=weights / weights.sum()))
        source = stage.tasks[source_index]
        rejected = []
        for _ in range(MAX_PLAYABLE_DRAWS):
            task_id = self._draw_task_id(source)
            if self._is_playable is None or self._is_playable(source.env, task_id):
                break
            rejected.append(task_id)
        else:
            raise RuntimeError(
                f"curriculum stage {stage.name!r}, task source #{source_index} (env {source.env!r}): "
                f"{MAX_PLAYABLE_DRAWS} task ids in a row are not playable (e.g. {rejected[:5]}). "
                f"Check that env {source.env!r} supports these tasks, or change the source in the curriculum config."
            )
        opponent = None if source.trace_difficulty is not None else (source.opponent or stage.opponent)
        seed = int(self._rng.integers(0, SEED_LIMIT))
        if source.seat is not None:  # the drawn seed's block of `players` seeds, at the asked-for seat
            players = players_of(game_name_of(task_id))
            seed = seed - seed % players + source.seat
            if seed >= SEED_LIMIT:
                seed -= players
        return Task(env=source.env, task_id=task_id, seed=seed, opponent=opponent, stage=stage.name, replay=False)

    def _draw_task_id(self, source: TaskSource) -> int:
        if source.games is not None:
            game = source.games[int(self._rng.integers(len(source.games)))]
            if source.config_ids is None:
                config_id = int(self._rng.integers(0, GAME_ID_STRIDE))
            else:
                config_id = source.config_ids[int(self._rng.integers(len(source.config_ids)))]
            return game_task_id(game, config_id)
        if source.trace_difficulty is not None:
            level = source.trace_difficulty[int(self._rng.integers(len(source.trace_difficulty)))]
            while True:  # never a held-out task, nor a held-out program under another id
                task_id = int(self._rng.integers(*trace_training_range(level)))
                if not repeats_a_held_out_program(task_id):
                    return task_id
        # one offset into the concatenated ranges: uniform over their union (overlaps count twice)
        offset = int(self._rng.integers(0, sum(hi - lo for lo, hi in source.task_id_ranges)))
        for lo, hi in source.task_id_ranges:
            if offset < hi - lo:
                return lo + offset
            offset -= hi - lo
        raise AssertionError("offset is below the total length of the ranges")

    # ------------------------------------------------------------------ results
    def report(self, task: Task, score: float, success: bool) -> bool:
        """Record one finished episode; returns True when it promoted the curriculum to the next stage.

        Scores are clipped to [0, 1] (the env contract); a NaN score raises ValueError.
        """
        if math.isnan(score):
            raise ValueError(f"episode score is NaN for task {task}; the env must report a score in [0, 1]")
        # a backend that falls back to a raw reward (e.g. -1 for a loss) must not end a long run here
        score = min(max(float(score), 0.0), 1.0)
        self._reported += 1
        if task.replay:
            self._replayed += 1
        else:
            totals = self._totals.setdefault(task.stage, {"episodes": 0, "successes": 0})
            totals["episodes"] += 1
            totals["successes"] += int(success)
        self._update_buffer(task, score, success)

        stage = self.stage
        if task.replay or task.stage != stage.name:
            return False
        self._window.append(float(success) if self.config.success_metric == "success" else float(score))
        self._stage_episodes += 1
        is_last = self._stage_index == len(self.config.stages) - 1
        if is_last or self._stage_episodes < stage.min_episodes or self._rolling() < stage.success_threshold:
            return False
        self._promotions.append({
            "from_stage": stage.name,
            "to_stage": self.config.stages[self._stage_index + 1].name,
            "episode": self._reported,
            "stage_episodes": self._stage_episodes,
        })
        self._stage_index += 1
        self._window.clear()
        self._stage_episodes = 0
        return True

    def _rolling(self) -> float:
        return math.fsum(self._window) / len(self._window) if self._window else 0.0

    def _update_buffer(self, task: Task, score: float, success: bool) -> None:
        key = _buffer_key(task)
        entry = self._buffer.get(key)
        if success:
            if task.replay and entry is not None:
                entry.successes += 1
                if entry.successes >= self.config.failure_buffer.mastery:
                    del self._buffer[key]
                    self._retired += 1
            return
        if entry is not None:
            entry.priority = 1.0 - score
            return
        self._buffer[key] = _FailedTask(task=replace(task, replay=True), priority=1.0 - score)
        if len(self._buffer) > self.config.failure_buffer.capacity:
            # min() keeps the first of equal priorities: ties evict the oldest entry
            evicted = min(self._buffer, key=lambda k: self._buffer[k].priority)
            del self._buffer[evicted]

    # ------------------------------------------------------------------ logging and checkpoints
    def stats(self) -> dict[str, float]:
        """Plain numbers for the metrics log."""
        stats: dict[str, float] = {
            "curriculum/stage_index": self._stage_index,
            "curriculum/rolling_success": self._rolling(),
            "curriculum/window_episodes": len(self._window),
            "curriculum/stage_episodes": self._stage_episodes,
            "curriculum/buffer_size": len(self._buffer),
            "curriculum/replayed": self._replayed,
            "curriculum/retired": self._retired,
            "curriculum/promotions": len(self._promotions),
        }
        for name, totals in self._totals.items():
            stats[f"curriculum/episodes/{name}"] = totals["episodes"]
            episodes = totals["episodes"]
            stats[f"curriculum/success_rate/{name}"] = totals["successes"] / episodes if episodes else 0.0
        return stats

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly, as JSON-serialisable data."""
        return {
            "version": STATE_VERSION,
            "rng": self._rng.bit_generator.state,
            "stage": self.stage.name,
            "window": list(self._window),
            "stage_episodes": self._stage_episodes,
            "totals": {name: dict(totals) for name, totals in self._totals.items()},
            "buffer": [
                {"task": asdict(entry.task), "priority": entry.priority, "successes": entry.successes}
                for entry in self._buffer.values()
            ],
            "reported": self._reported,
            "replayed": self._replayed,
            "retired": self._retired,
            "promotions": self.promotions,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict()`; the current stage is found by name in this config."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"curriculum state version {state.get('version')!r} is not {STATE_VERSION}")
        names = [stage.name for stage in self.config.stages]
        if state["stage"] not in names:
            raise ValueError(
                f"checkpoint's curriculum stage {state['stage']!r} is not among the configured stages {names}; "
                "resume with the curriculum config the run was started with"
            )
        self._rng.bit_generator.state = state["rng"]
        self._stage_index = names.index(state["stage"])
        self._window = deque(state["window"], maxlen=self.config.window)
        self._stage_episodes = state["stage_episodes"]
        self._totals = {name: {"episodes": 0, "successes": 0} for name in names}
        self._totals.update({name: dict(totals) for name, totals in state["totals"].items()})
        self._buffer = {}
        for item in state["buffer"]:
            task = Task(**item["task"])
            self._buffer[_buffer_key(task)] = _FailedTask(task, item["priority"], item["successes"])
        self._reported = state["reported"]
        self._replayed = state["replayed"]
        self._retired = state["retired"]
        self._promotions = [dict(p) for p in state["promotions"]]
