"""Expert games: the env's evaluate() conversation with a teacher (experts.py) in the model's seat, played as jobs
on a pool of worker processes."""
from __future__ import annotations

import json
import logging
import multiprocessing
import os
import uuid
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ppo_affine.config import DEFAULT_CACHE_DIR, Config, EnvSpec
from ppo_affine.seeds import derive_seed
from ppo_affine.run_log import rollout_progress
from ppo_affine.warm_start.config import WarmStartConfig, game_count

log = logging.getLogger(__name__)

# MCTS simulations / playouts per bid / unused (the other experts)
DEFAULT_BUDGET = {"mcts": 300, "montecarlo": 20, "cfr": 0, "best_response": 0, "true_bids": 0, "count_bids": 0,
                  "prize": 0, "simple_gin": 0}


@dataclass(frozen=True)
class Teacher:
    """The expert in the model's seat: its kind (experts.KINDS), its effort and how it replies."""
    kind: str
    budget: int  # MCTS simulations, or Monte Carlo playouts per bid
    cfr_iterations: int = 300
    with_reason: bool = False  # replies '<think>reason</think>ID' instead of the ID alone

    @classmethod
    def for_game(cls, game: str, experts: dict[str, str] | None = None, budget: int | None = None,
                 cfr_iterations: int = 300, with_reason: bool = False) -> Teacher:
        """`game`'s teacher: `experts[game]`, else the game's default; `budget` None: the kind's default."""
        from ppo_affine.experts import expert_kind

        kind = expert_kind(game, experts)
        return cls(kind, budget or DEFAULT_BUDGET[kind], cfr_iterations, with_reason)

    @classmethod
    def of(cls, game: str, settings: WarmStartConfig) -> Teacher:
        """`game`'s teacher as the options set it (--expert, --expert-budget, --cfr-iterations, --reason)."""
        return cls.for_game(game, settings.experts, settings.expert_budget, settings.cfr_iterations,
                            settings.with_reason(game))


@dataclass(frozen=True)
class OpponentSetup:
    """The env's MCTS opponent as the teachers meet it (EnvSpec's settings), and where the best-response teacher
    keeps its model of that opponent."""
    simulations: int | dict[str, int] | None = None  # one budget, or {game: budget} (unnamed games: the env's)
    search: str = "fast"  # the MCTS opponent's implementation (openspiel_episode.SEARCHES)
    moves: str | None = None  # a file of recorded opponent moves to replay (EnvSpec.opponent_moves)
    cache_dir: str = DEFAULT_CACHE_DIR

    @classmethod
    def of(cls, config: Config, simulations: int | None = None) -> OpponentSetup:
        """The opponent of `config`'s game env (its first openspiel env), at `simulations` when given."""
        spec = game_env(config)
        return cls(spec.mcts_simulations if simulations is None else simulations, spec.opponent_search,
                   spec.opponent_moves, config.train.model.cache_dir)

    def budget(self, game: str) -> int | None:
        """The opponent's simulations in `game` (None: the game's validator budget)."""
        return self.simulations.get(game) if isinstance(self.simulations, dict) else self.simulations

    def episode(self, task_id: int, seed: int, opponent: str, game: str):
        """A new game of the env's evaluate() conversation against this opponent."""
        from ppo_affine.envs.openspiel_episode import Episode

        return Episode(uuid.uuid4().hex, task_id=task_id, seed=seed, opponent=opponent, observation_format="evaluate",
                       max_parse_attempts=3, mcts_simulations=self.budget(game), opponent_search=self.search,
                       opponent_moves=self.moves)

    def expert(self, teacher: Teacher, episode, seed: int):
        """`teacher` playing `episode`'s model seat against this opponent."""
        from ppo_affine.experts import Expert

        return Expert(teacher.kind, episode.game, episode.player, seed, teacher.budget, teacher.cfr_iterations,
                      self.cache_dir, self.budget(episode.game_name))


def game_env(config: Config) -> EnvSpec:
    """The configuration's game env: its first openspiel env, else the default one."""
    return next((s for s in config.env.envs.values() if s.kind == "openspiel"), EnvSpec(kind="openspiel"))


@dataclass(frozen=True)
class ExpertJob:
    """One expert game to play."""
    game: str
    task_id: int
    seed: int  # its parity is the model's seat
    opponent: str  # "random" or "mcts"
    teacher: Teacher
    setup: OpponentSetup
    explore: float = 0.0  # chance that a turn plays a uniformly random legal move (not trained on)
    max_replies: int | None = None  # the record ends after this many expert replies (None: the whole game)


def plan_jobs(settings: WarmStartConfig, seed: int, setup: OpponentSetup) -> list[ExpertJob]:
    """`settings.episodes` jobs per game over `settings.config_ids`, then `settings.openings` jobs per game (counted
    alike), on seeds of their own, that end after the expert's first reply and play no random moves. Consecutive
    seeds alternate the model's seat."""
    from ppo_affine.envs.tasks import game_task_id

    config_ids = settings.config_ids

    def job(game: str, i: int, stream: str, explore: float, max_replies: int | None) -> ExpertJob:
        return ExpertJob(game, game_task_id(game, config_ids[i % len(config_ids)]),
                         (derive_seed(seed, stream, game, i) & ~1) | (i % 2),  # parity = the model's seat
                         settings.opponent, Teacher.of(game, settings), setup, explore, max_replies)

    games = settings.games
    return ([job(game, i, "sft", settings.explore, None)
             for game in games for i in range(game_count(settings.episodes, game))]
            + [job(game, i, "sft-opening", 0.0, 1)
               for game in games for i in range(game_count(settings.openings, game))])


def play_expert_episode(job: ExpertJob) -> dict[str, Any]:
    """One episode of the env's evaluate() game with the expert in the model's seat, as a conversation.

    With `job.explore` > 0 a turn plays a uniformly random legal move at that chance, and the record lists
    those replies (`explored_replies`, their places among the assistant replies): SFT does not train on
    them, but on the expert's answers from the states they lead to, which the expert's own games never
    reach (a goofspiel prize whose matching card is gone) and a student's slips do.

    With `job.max_replies` the record stops after that many expert replies, before the game ends: its
    `score` is None and `max_replies` says where it was cut."""
    import random

    episode = job.setup.episode(job.task_id, job.seed, job.opponent, job.game)
    expert = job.setup.expert(job.teacher, episode, job.seed)
    result = episode.start()
    messages = [{"role": "system", "content": episode.system_prompt},
                {"role": "user", "content": result["observation"]}]
    explorer = random.Random(derive_seed(job.seed, "explore"))
    explored = []
    while not result["done"]:
        if job.explore and explorer.random() < job.explore:
            explored.append(sum(m["role"] == "assistant" for m in messages))
            reply = str(explorer.choice(episode.legal))
        else:
            reply = expert_reply(expert, episode, job.teacher.with_reason)[1]
        messages.append({"role": "assistant", "content": reply})
        if job.max_replies is not None and sum(m["role"] == "assistant" for m in messages) == job.max_replies:
            break
        result = episode.step(reply)
        if not result["done"]:
            messages.append({"role": "user", "content": result["observation"]})
    record = {"step": 0, "env": "openspiel", "task_id": job.task_id, "seed": job.seed, "game": job.game,
              "score": episode.score if result["done"] else None, "error": None, "messages": messages,
              "expert": expert.kind, "opponent": job.opponent, "llm_player_id": episode.player,
              "explored_replies": explored}
    if job.max_replies is not None:
        record["max_replies"] = job.max_replies
    return record


def expert_reply(expert, episode, with_reason: bool) -> tuple[int, str]:
    """The expert's move at the episode's pending decision and the reply that plays it (ID, or reason + ID)."""
    action, reason = expert.choose(episode.state, dict(zip(episode.legal, episode.labels)))
    return action, f"<think>{reason}</think>{action}" if with_reason else str(action)


def warn_teachers_aimed_elsewhere(games: list[str], experts: dict[str, str] | None, opponent: str) -> None:
    """One warning when a game's teacher is aimed at the MCTS opponent (experts.AIMED_AT_MCTS) but meets another."""
    from ppo_affine.experts import AIMED_AT_MCTS, expert_choices, expert_kind

    if opponent == "mcts":
        return
    aimed = [f"{game}={kind}" for game in games
             if expert_choices(game) and (kind := expert_kind(game, experts)) in AIMED_AT_MCTS]
    if aimed:
        log.warning("%s: teachers aimed at the MCTS opponent meet the %s one here, so their moves answer a player "
                    "that is not there (the mcts opponent, or another teacher, fits)", ", ".join(aimed), opponent)


def write_records(path: Path, records: list[dict[str, Any]]) -> None:
    """JSONL, replaced whole: a crash mid-write leaves the earlier file."""
    staging = path.with_suffix(".jsonl.tmp")
    staging.write_text("".join(json.dumps(r) + "\n" for r in records))
    os.replace(staging, path)


def run_jobs(function, jobs: list, workers: int, what: str) -> list:
    """`function(job)` for every job on `workers` processes, with a progress bar; results in job order."""
    if not jobs:  # no pool to start (e.g. --teacher-moves over rows without conversations)
        return []
    results: list = [None] * len(jobs)
    with rollout_progress(len(jobs), f"{what} ({workers} processes)") as advance:
        # spawn, not fork: the caller may hold a loaded model, threads (torch) and open SQLite connections
        with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = {pool.submit(function, job): i for i, job in enumerate(jobs)}
            for future in as_completed(futures):
                results[futures[future]] = future.result()
                advance()
    return results


def generate(jobs: list[ExpertJob], workers: int, path: Path | None) -> list[dict[str, Any]]:
    """Play every job on `workers` processes; records in job order, also written to `path` as JSONL."""
    records = run_jobs(play_expert_episode, jobs, workers, "expert episodes")
    if path is not None:
        write_records(path, records)
    return [r for r in records if r is not None]
