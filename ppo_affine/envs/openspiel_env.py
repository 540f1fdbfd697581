"""The Affine OpenSpiel game env, embedded: many concurrent episodes of the 22 games behind the async
OpenEnv interface of ppo_affine/envs/base.py, faithful to docs/protocols.md, 'The game env (Affine OpenSpiel)'.

The per-game table and task-id decoding live in games.py, one game's logic and protocol in
openspiel_episode.Episode (synchronous; it also builds the opponents, `opponent_search` picking the
exact or the fast MCTS). This module keeps the episode registry and decides where each move runs:
- `workers=0`: in this process. Moves that can take seconds (MCTS searches, dealing bridge) run in
  a thread, random-opponent moves (microseconds) run inline. The fast (C++) search releases the GIL,
  so concurrent episodes' fast searches run in parallel on those threads; the exact (Python) search
  holds it, so its searches take turns.
- `workers=N`: episodes live in N spawned worker processes, each episode on one worker for its
  whole life, so the searches of concurrent episodes use N cores. An episode's moves depend only on
  its own seeds, so results are identical to in-process ones. The trainer's config sizes N to the
  machine (factory.game_workers), which the exact search needs to use more than one core. A new
  episode goes to the worker with the least work left, costed from the finished episodes of its game,
  opponent and seat (EpisodeCosts): by count, one worker could get every episode that searches. Kinds
  that cost less than INLINE_SECONDS an episode (and, before any finished, those against a random
  opponent) play in this process instead, where no search queued before them holds their moves.
`opponent_moves` names a file of recorded opponent moves that episodes on repeated seeds replay
instead of searching again (opponent_moves.py): evaluations of several models on the same seeds.
"""
from __future__ import annotations

import asyncio
import multiprocessing
import operator
import random
import time
import uuid
from collections import Counter, OrderedDict
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

from ppo_affine.envs.base import StepResult, step_result
from ppo_affine.envs.games import decode_task_id, is_playable
from ppo_affine.envs.openspiel_episode import SEARCHES, Episode, episode_seat
from ppo_affine.envs.openspiel_text import FORMATS
from ppo_affine.envs.opponent_moves import OpponentMoves

__all__ = ["OpenSpielEnv", "decode_task_id", "is_playable"]

OPPONENTS = ("mcts", "random")
TASK_ID_SPACE = 10**11  # a missing task id is drawn from [0, 10^11), like the Affine env
SEED_SPACE = 2**32
FINISHED_KEPT = 256  # finished episodes whose final result step/state can still report
# With workers, a kind of episode that costs less than this (seconds, all its moves) plays in this process: see
# OpenSpielEnv._plays_here. A leduc_poker episode against the validators' MCTS costs ~0.02 s, liars_dice's where
# the opponent moves first ~0.5 s.
INLINE_SECONDS = 0.05

_WORKER_EPISODES: dict[str, Episode] = {}  # the episodes a worker process holds


def _in_worker(method: str, episode_id: str, argument: Any) -> tuple[StepResult | None, float]:
    """One call on an episode held by this worker process (None when it does not hold it), and the CPU seconds
    the worker spent on it."""
    return _timed(_call_in_worker, method, episode_id, argument)


def _timed(function, *args) -> tuple[Any, float]:
    """function(*args) and the CPU seconds of the thread that ran it: what an episode costs, not the time it
    waited for a core or the GIL."""
    started = time.thread_time()
    return function(*args), time.thread_time() - started


def _call_in_worker(method: str, episode_id: str, argument: Any) -> StepResult | None:
    if method == "reset":
        _WORKER_EPISODES[episode_id] = Episode(episode_id, **argument)
        result = _WORKER_EPISODES[episode_id].start()
    elif method == "stop":
        _WORKER_EPISODES.pop(episode_id, None)
        return None
    elif episode_id not in _WORKER_EPISODES:
        return None
    elif method == "step":
        result = _WORKER_EPISODES[episode_id].step(argument)
    else:
        result = _WORKER_EPISODES[episode_id].observe()
    if result["done"]:
        del _WORKER_EPISODES[episode_id]
    return result


def _error(kind: str, message: str, retryable: bool = False) -> dict[str, Any]:
    return {"type": kind, "message": message, "retryable": retryable}


def _blank_info() -> dict[str, Any]:
    return {
        "task_id": None, "seed": None, "game_name": None, "llm_player_id": None, "opponent_type": None,
        "system_prompt": None, "turn_prompt": "", "parse_error": False, "legal_actions": [],
        "illegal_moves": 0, "turns": 0, "step_count": 0,
    }


@dataclass
class _Live:
    lock: asyncio.Lock  # one move at a time per episode
    episode: Episode | None = None  # in-process mode
    worker: int | None = None  # workers mode: index of the process holding the episode
    kind: tuple[str, str, int] | None = None  # workers mode: (game, opponent, the model's seat), EpisodeCosts' key
    expected: float = 1.0  # workers mode: the seconds its worker is expected to spend on it, and has spent
    spent: float = 0.0

    @property
    def left(self) -> float:
        # an episode that outran its estimate still has work: a tenth of the estimate
        return max(self.expected - self.spent, 0.1 * self.expected)


class EpisodeCosts:
    """Worker seconds per episode, by game, opponent and the model's seat (whether the opponent moves first
    decides a search more or less): a running mean over finished episodes.
    Searches cost seconds where a random opponent costs microseconds, so a count of episodes balances nothing;
    before any episode of a kind finished, it costs the mean of the kinds that did (1.0 before any did)."""

    def __init__(self):
        self._sum: Counter = Counter()
        self._count: Counter = Counter()

    def measured(self, kind: tuple[str, str, int]) -> float | None:
        """The kind's mean, None before one of its episodes finished."""
        return self._sum[kind] / self._count[kind] if self._count[kind] else None

    def expected(self, kind: tuple[str, str, int]) -> float:
        measured = self.measured(kind)
        if measured is not None:
            return measured
        total = sum(self._count.values())
        return sum(self._sum.values()) / total if total else 1.0

    def finished(self, kind: tuple[str, str, int], seconds: float) -> None:
        if self._count[kind] >= 256:  # a running mean that follows a change (e.g. the model's play) slowly
            self._sum[kind] *= 0.5
            self._count[kind] //= 2
        self._sum[kind] += seconds
        self._count[kind] += 1


class OpenSpielEnv:
    """Many concurrent Affine game episodes; see the module docstring for where moves run."""

    def __init__(self, observation_format: str = "evaluate", seed: int = 0, max_parse_attempts: int = 3,
                 mcts_simulations: int | dict[str, int] | None = None, workers: int = 0,
                 opponent_search: str = "fast", opponent_moves: str | None = None):
        if observation_format not in FORMATS:
            raise ValueError(f"observation_format must be one of {FORMATS}, got {observation_format!r}")
        if max_parse_attempts < 1:
            raise ValueError(f"max_parse_attempts must be >= 1, got {max_parse_attempts}")
        budgets = mcts_simulations.values() if isinstance(mcts_simulations, dict) else [mcts_simulations]
        if any(b is not None and b < 1 for b in budgets):
            raise ValueError(f"mcts_simulations must be >= 1, a {{game: simulations}} mapping of such, or None (the "
                             f"spec's budgets), got {mcts_simulations}")
        if workers < 0:
            raise ValueError(f"workers must be >= 0 (0 = in this process), got {workers}")
        if opponent_search not in SEARCHES:
            raise ValueError(f"opponent_search must be one of {SEARCHES}, got {opponent_search!r}")
        self.observation_format = observation_format
        self.opponent_search = opponent_search
        self.opponent_moves = opponent_moves and str(opponent_moves)
        if self.opponent_moves:  # a bad path fails here, not in a worker; the file appears at the first search
            OpponentMoves(self.opponent_moves).check()
        self.max_parse_attempts = max_parse_attempts
        self.mcts_simulations = mcts_simulations
        self._rng = random.Random(seed)  # draws the task ids and seeds that callers leave out
        self._workers = [self._new_worker() for _ in range(workers)]
        self.costs = EpisodeCosts()
        self.cpu_seconds_here = 0.0  # with workers: the CPU seconds of the moves played in this process
        self._live: dict[str, _Live] = {}
        self._finished: OrderedDict[str, StepResult] = OrderedDict()

    async def reset(self, task_id: int | None = None, seed: int | None = None, opponent: str = "mcts",
                    **kwargs: Any) -> StepResult:
        if kwargs:
            raise TypeError(f"OpenSpielEnv.reset() got unexpected arguments {sorted(kwargs)}; "
                            "it takes task_id, seed and opponent")
        if opponent not in OPPONENTS:
            raise ValueError(f"opponent must be one of {OPPONENTS}, got {opponent!r}")
        task_id = self._rng.randrange(TASK_ID_SPACE) if task_id is None else operator.index(task_id)
        seed = self._rng.randrange(SEED_SPACE) if seed is None else operator.index(seed)
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        if not is_playable(task_id):
            decoded = decode_task_id(task_id)
            game_name, params = decoded["game_name"], decoded["game_params"]
            info = _blank_info() | {
                "task_id": task_id, "seed": seed, "game_name": game_name, "opponent_type": opponent,
                "score": 0.0, "success": False,
                "error": _error("invalid_game", f"task {task_id} asks for {game_name} with parameters {params}, "
                                "which open_spiel cannot load; sample task ids for which is_playable() is True"),
            }
            return step_result(f"Error: task {task_id} ({game_name} {params}) cannot be played.",
                               done=True, truncated=True, info=info)
        episode_id = uuid.uuid4().hex
        settings = {
            "task_id": task_id, "seed": seed, "opponent": opponent, "observation_format": self.observation_format,
            "max_parse_attempts": self.max_parse_attempts, "mcts_simulations": self.mcts_simulations,
            "opponent_search": self.opponent_search, "opponent_moves": self.opponent_moves,
        }
        live = self._live[episode_id] = _Live(asyncio.Lock())
        if self._workers:
            live.kind = (decode_task_id(task_id)["game_name"], opponent, episode_seat(task_id, seed,
                                                                                     self.observation_format))
            live.expected = self.costs.expected(live.kind)
            if not self._plays_here(live.kind, opponent):
                live.worker = self._least_loaded_worker()
        async with live.lock:
            if live.worker is not None:
                return self._settle(episode_id, await self._call_worker(live, "reset", episode_id, settings))
            live.episode, built = _timed(lambda: Episode(episode_id, **settings))
            # Always in a thread: completing a bridge deal runs a double-dummy solver (0.5-3 s).
            result, started = await asyncio.to_thread(_timed, live.episode.start)
            self._charge_here(live, built + started)
            return self._settle(episode_id, result)

    async def step(self, action: str, episode_id: str) -> StepResult:
        live = self._live.get(episode_id) if episode_id else None
        if live is None:
            return self._missing(episode_id, stepping=True)
        async with live.lock:
            if episode_id not in self._live:  # finished or stopped while this call waited
                return self._missing(episode_id, stepping=True)
            if live.worker is not None:
                result = await self._call_worker(live, "step", episode_id, action)
            else:
                if live.episode.has_search_bot:
                    result, seconds = await asyncio.to_thread(_timed, live.episode.step, action)
                else:
                    result, seconds = _timed(live.episode.step, action)
                self._charge_here(live, seconds)
            return self._settle(episode_id, result)

    async def state(self, episode_id: str) -> StepResult:
        live = self._live.get(episode_id) if episode_id else None
        if live is None:
            return self._missing(episode_id, stepping=False)
        async with live.lock:
            if episode_id not in self._live:
                return self._missing(episode_id, stepping=False)
            if live.worker is not None:
                return await self._call_worker(live, "state", episode_id, None)
            return live.episode.observe()

    async def stop(self, episode_id: str) -> dict[str, Any]:
        # No lock: stopping must not wait for a search in flight; its result is then discarded.
        live = self._live.pop(episode_id, None)
        finished = self._finished.pop(episode_id, None)
        if live is not None and live.worker is not None:
            await self._call_worker(live, "stop", episode_id, None)
        return {"status": "ok", "stopped": live is not None or finished is not None, "episode_id": episode_id}

    async def close(self) -> None:
        for worker in self._workers:
            worker.shutdown(wait=False, cancel_futures=True)
        self._workers = []
        self._live.clear()
        self._finished.clear()

    @staticmethod
    def _new_worker() -> ProcessPoolExecutor:
        # spawn, not fork: the trainer process holds threads (torch, asyncio) that fork would copy.
        return ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))

    def _plays_here(self, kind: tuple[str, str, int], opponent: str) -> bool:
        """Whether an episode plays in this process although there are workers: a worker runs one call at a time,
        so a move of microseconds there waits behind the searches queued before it (in the validator rollout a
        third of the episodes were held ~0.4 s so, the model idle meanwhile). Here go the kinds that cost less
        than INLINE_SECONDS an episode where measured, and before that those without a search opponent (a
        random one); the fast search releases the GIL, so a short one costs this process what it would cost a
        worker's."""
        measured = self.costs.measured(kind)
        return measured < INLINE_SECONDS if measured is not None else opponent != "mcts"

    def _charge_here(self, live: _Live, seconds: float) -> None:
        """A move played in this process: its episode's cost, and this process's share of the env's CPU."""
        live.spent += seconds
        self.cpu_seconds_here += seconds

    def _least_loaded_worker(self) -> int:
        """The worker with the fewest expected seconds left on its live episodes."""
        load = Counter()
        for live in self._live.values():
            if live.worker is not None:
                load[live.worker] += live.left
        return min(range(len(self._workers)), key=lambda index: load[index])

    async def _call_worker(self, live: _Live, method: str, episode_id: str, argument: Any) -> StepResult | None:
        worker = self._workers[live.worker]
        try:
            result, seconds = await asyncio.get_running_loop().run_in_executor(
                worker, _in_worker, method, episode_id, argument)
            live.spent += seconds
        except BrokenProcessPool:
            self._replace_dead_worker(live.worker, worker)
            if method == "stop":
                return None
            return step_result(
                "Error: the worker process holding this episode died; start a new episode.",
                done=True, truncated=True, episode_id=episode_id,
                info=_blank_info() | {"error": _error("worker_lost", f"worker {live.worker} died", retryable=True)})
        if result is None and method != "stop":
            return self._missing(episode_id, stepping=method == "step")
        return result

    def _replace_dead_worker(self, index: int, dead: ProcessPoolExecutor) -> None:
        if self._workers[index] is not dead:
            return  # another call saw the same death first
        dead.shutdown(wait=False, cancel_futures=True)
        self._workers[index] = self._new_worker()
        for episode_id in [e for e, live in self._live.items() if live.worker == index]:
            del self._live[episode_id]

    def _settle(self, episode_id: str, result: StepResult) -> StepResult:
        """Free a finished episode, keeping its final result for late step/state calls."""
        live = self._live.pop(episode_id, None) if result["done"] else None
        if live is not None and live.kind is not None and not result["info"].get("error"):
            self.costs.finished(live.kind, live.spent)
        if live is not None:
            self._finished[episode_id] = result
            while len(self._finished) > FINISHED_KEPT:
                self._finished.popitem(last=False)
        return result

    def _missing(self, episode_id: str, stepping: bool) -> StepResult:
        if not episode_id:
            return step_result("Error: no episode_id given; call reset() first.", done=True, truncated=True,
                               info=_blank_info() | {"error": _error("no_episode_id", "episode_id is empty")})
        if episode_id in self._finished:
            final = self._finished[episode_id]
            info = dict(final["info"])
            if stepping:
                info["error"] = _error("episode_done", f"episode {episode_id} has finished; call reset()")
            return step_result(final["observation"], done=True, episode_id=episode_id, info=info)
        return step_result(
            f"Error: unknown episode {episode_id!r} (stopped, never started, or finished long ago).",
            done=True, truncated=True, episode_id=episode_id,
            info=_blank_info() | {"error": _error("episode_not_found", f"no episode {episode_id!r}")})
