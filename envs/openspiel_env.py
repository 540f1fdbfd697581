"""The Affine OpenSpiel game env, in-process: all 22 games, both observation formats, MCTS/random opponents.

Faithful to /work/shared/specs/affine-openspiel.md. The default `evaluate` format replays the
validators' evaluate() game turn by turn, the trainer supplying each reply: LLM seat (seed % 2) % n,
one bot per other seat seeded seed+4+p (random) or seed+5+p / seed+6+p (MCTS), chance outcomes
from RandomState(seed), joint moves at simultaneous nodes, the three-rule parser after think-tag
stripping, and a lost game (score 0) after 3 unusable replies to one decision. The `openenv` format
is the reset/step protocol: seat seed % n, one set of bot streams (seed+2 / +3 / +4), chance from
RandomState(seed+100), first-digit-run parser, -0.01 per unusable action and no attempt limit.

Where the real env crashes we play on correctly: a blackjack ten counts 10, 4-player games with the
random opponent pick from the seat to move, goofspiel in openenv shows the legal cards and applies
the joint move as chosen. Seeds are reduced mod 2**32 after their offsets instead of overflowing.
"""
from __future__ import annotations

import asyncio
import functools
import operator
import random
import uuid
from collections import OrderedDict
from typing import Any, Callable

import numpy as np
import pyspiel
from open_spiel.python.algorithms import mcts
from open_spiel.python.bots.uniform_random import UniformRandomBot

from envs import openspiel_text as text
from envs.base import StepResult, step_result
from envs.games import GAMES, GameSpec, describe_default
from envs.tasks import AVAILABLE_GAMES, GAME_ID_STRIDE

OPPONENTS = ("mcts", "random")
TASK_ID_SPACE = 10**11  # a missing task id is drawn from [0, 10^11), like the Affine env
SEED_SPACE = 2**32
UCT_C = 1.414
INVALID_ACTION_PENALTY = -0.01  # openenv format only
FINISHED_KEPT = 256  # finished episodes whose final result step/state can still report


def decode_task_id(task_id: int) -> dict[str, Any]:
    """Game and parameters of a task id, exactly as the Affine env decodes them (the game index wraps
    modulo 22; the parameters may include names open_spiel rejects, see `is_playable`)."""
    task_id = operator.index(task_id)
    game_idx, config_id = divmod(task_id, GAME_ID_STRIDE)
    game_name = AVAILABLE_GAMES[game_idx % len(AVAILABLE_GAMES)]
    return {
        "game_name": game_name, "game_idx": game_idx, "config_id": config_id,
        "game_params": GAMES[game_name].params(config_id),
    }


def is_playable(task_id: int) -> bool:
    """False for the tasks open_spiel cannot load (bridge variants 1 and 2); oware is repaired."""
    decoded = decode_task_id(task_id)
    return not set(decoded["game_params"]) & GAMES[decoded["game_name"]].unsupported_params


@functools.lru_cache(maxsize=None)
def _load_game(game_name: str, params: tuple[tuple[str, Any], ...]) -> pyspiel.Game:
    spec = GAMES[game_name]
    return pyspiel.load_game(game_name, {spec.renamed_params.get(k, k): v for k, v in params})


def compute_score(returns: list[float], player: int, zero_sum: bool, min_utility: float,
                  max_utility: float) -> float:
    """Affine's score in [0, 1] (spec section 5): min/max normalisation for zero-sum games, place
    among the players for general-sum games of 3+, else win/draw/loss or normalisation."""
    mine = returns[player]
    if zero_sum or len(returns) == 1:
        if max_utility <= min_utility:
            score = 0.0 if zero_sum else 0.5
        else:
            score = (mine - min_utility) / (max_utility - min_utility)
    elif len(returns) > 2:
        # Ties share the better place: the index of the first equal return in descending order.
        score = 1.0 - sorted(returns, reverse=True).index(mine) / (len(returns) - 1)
    else:
        other = returns[1 - player]
        score = 1.0 if mine > other else 0.5 if mine == other else 0.0
    # Returns never leave [min, max] in open_spiel; the clip only guarantees the contract.
    return min(1.0, max(0.0, score))


class AffineRolloutEvaluator(mcts.Evaluator):
    """The Affine env's MCTS leaf evaluator: the mean return of n random playouts, which choose
    uniformly among `legal_actions()` at every node, chance nodes included; uniform priors."""

    def __init__(self, n_rollouts: int, rng: np.random.RandomState):
        self.n_rollouts = n_rollouts
        self._rng = rng

    def evaluate(self, state: pyspiel.State) -> np.ndarray:
        if state.is_terminal() or not state.legal_actions():
            return np.array(state.returns())
        total = np.zeros(state.get_game().num_players())
        for _ in range(self.n_rollouts):
            playout = state.clone()
            while not playout.is_terminal():
                actions = playout.legal_actions()
                # Same draw as rng.choice(actions) from the same stream, at a fifth of the cost.
                playout.apply_action(actions[self._rng.randint(len(actions))])
            total += playout.returns()
        return total / self.n_rollouts

    def prior(self, state: pyspiel.State) -> list[tuple[int, float]]:
        actions = state.legal_actions()
        return [(action, 1.0 / len(actions)) for action in actions]


def _rng(seed: int) -> np.random.RandomState:
    return np.random.RandomState(seed % SEED_SPACE)


def _mcts_bot(game: pyspiel.Game, budget: tuple[int, int], rollout_seed: int, search_seed: int) -> mcts.MCTSBot:
    max_simulations, n_rollouts = budget
    evaluator = AffineRolloutEvaluator(n_rollouts, _rng(rollout_seed))
    return mcts.MCTSBot(game, UCT_C, max_simulations, evaluator, random_state=_rng(search_seed))


def build_bots(game: pyspiel.Game, spec: GameSpec, observation_format: str, player: int, seed: int,
               opponent: str, mcts_simulations: int | None) -> dict[int, pyspiel.Bot]:
    """A bot for every seat but the model's (spec sections 2 and 6.3); empty for 1-player games."""
    seats = [p for p in range(game.num_players()) if p != player]
    simultaneous = game.get_type().dynamics == pyspiel.GameType.Dynamics.SIMULTANEOUS
    budget = None
    if opponent == "mcts" and spec.mcts is not None and not simultaneous:
        budget = (mcts_simulations or spec.mcts[0], spec.mcts[1])
    if observation_format == "evaluate":
        if budget:
            return {p: _mcts_bot(game, budget, seed + 5 + p, seed + 6 + p) for p in seats}
        return {p: UniformRandomBot(p, _rng(seed + 4 + p)) for p in seats}
    # openenv: one bot's random streams serve every other seat. Affine's single random bot asks
    # for player 0's legal actions whoever is to move, which crashes 4-player games; sharing
    # the stream between per-seat bots keeps its draws and plays legal moves.
    if budget:
        bot = _mcts_bot(game, budget, seed + 3, seed + 4)
        return {p: bot for p in seats}
    stream = _rng(seed + 2)
    return {p: UniformRandomBot(p, stream) for p in seats}


def _label(state: pyspiel.State, player: int, action: int) -> str:
    try:
        return state.action_to_string(player, action)
    except pyspiel.SpielError:
        return str(action)


class Episode:
    """One game in progress: the pyspiel state, the bots, and the model's pending decision.

    Synchronous; OpenSpielEnv runs its moves off the event loop when a search bot is involved.
    """

    def __init__(self, game_name: str, game: pyspiel.Game, *, task_id: int, seed: int, opponent: str,
                 observation_format: str, mcts_simulations: int | None):
        self.game_name, self.game, self.task_id, self.seed = game_name, game, task_id, seed
        self.opponent, self.format = opponent, observation_format
        self.spec = GAMES[game_name]
        num_players = game.num_players()
        evaluate = observation_format == "evaluate"
        self.player = (seed % 2) % num_players if evaluate else seed % num_players
        self.bots = build_bots(game, self.spec, observation_format, self.player, seed, opponent, mcts_simulations)
        self.has_search_bot = any(isinstance(bot, mcts.MCTSBot) for bot in self.bots.values())
        self.chance_rng = _rng(seed if evaluate else seed + 100)
        # openenv puts the rules in the first observation instead of a system message.
        self.system_prompt = text.system_prompt(game_name, self.spec.rules) if evaluate else None
        self.state = game.new_initial_state()
        self.lock = asyncio.Lock()
        self.step_count = 0  # applied player moves, model and opponents (a joint move counts once)
        self.turns = 0  # model decisions applied
        self.illegal_moves = 0
        self.attempt = 1  # evaluate format: which reply to the pending decision comes next
        self.cumulative_reward = 0.0  # openenv bookkeeping, mirrors the real env's mix
        self.last_opponent_action: int | None = None
        self.forfeited = False
        self.legal: list[int] = []
        self.labels: list[str] = []
        self.turn_prompt = ""

    @property
    def done(self) -> bool:
        return self.forfeited or self.state.is_terminal()

    @property
    def returns(self) -> list[float] | None:
        return None if self.forfeited else list(self.state.returns())

    @property
    def score(self) -> float:
        if self.forfeited:
            return 0.0
        game_type = self.game.get_type()
        return compute_score(self.state.returns(), self.player, game_type.utility == pyspiel.GameType.Utility.ZERO_SUM,
                             self.game.min_utility(), self.game.max_utility())

    def advance(self) -> float:
        """Play chance nodes and the other seats until the model must decide or the game ends.

        Returns the model's raw rewards collected on the way (non-zero only in 2048 and solitaire).
        """
        state, reward = self.state, 0.0
        while not state.is_terminal():
            if state.is_chance_node():
                outcomes, probs = zip(*state.chance_outcomes())
                state.apply_action(int(self.chance_rng.choice(outcomes, p=probs)))
                continue
            # Goofspiel, the one simultaneous game, deals both players a card at every such node.
            if state.is_simultaneous_node() or state.current_player() == self.player:
                break
            action = int(self.bots[state.current_player()].step(state))
            state.apply_action(action)
            self.step_count += 1
            self.last_opponent_action = action
            reward += state.rewards()[self.player]
        self._prepare_decision()
        return reward

    def take_turn(self, action: int) -> tuple[float, float | None]:
        """Apply the model's legal action, then advance. Returns (the model's raw reward for its move,
        the rewards collected while advancing, or None when the model's move ended the game)."""
        state = self.state
        if state.is_simultaneous_node():
            state.apply_actions([
                action if p == self.player
                else int(self.bots[p].step(state)) if state.legal_actions(p) else pyspiel.INVALID_ACTION
                for p in range(self.game.num_players())
            ])
        else:
            state.apply_action(action)
        self.step_count += 1
        self.turns += 1
        self.attempt = 1
        own = state.rewards()[self.player]
        if state.is_terminal():
            self._prepare_decision()
            return own, None
        return own, self.advance()

    def _prepare_decision(self) -> None:
        if self.done:
            self.legal, self.labels, self.turn_prompt = [], [], ""
            return
        self.legal = self.state.legal_actions(self.player)
        self.labels = [_label(self.state, self.player, a) for a in self.legal]
        description = (self.spec.describe or describe_default)(self.state, self.player)
        if self.format == "evaluate":
            self.turn_prompt = text.evaluate_turn_prompt(description, self.player, self.legal, self.labels)
        else:
            self.turn_prompt = text.openenv_state_block(
                self.game_name, self.player, description, self.legal, self.labels)


def _error(kind: str, message: str, retryable: bool = False) -> dict[str, Any]:
    return {"type": kind, "message": message, "retryable": retryable}


class OpenSpielEnv:
    """Many concurrent Affine game episodes behind the async OpenEnv interface of envs/base.py."""

    def __init__(self, observation_format: str = "evaluate", seed: int = 0, max_parse_attempts: int = 3,
                 mcts_simulations: int | None = None):
        if observation_format not in text.FORMATS:
            raise ValueError(f"observation_format must be one of {text.FORMATS}, got {observation_format!r}")
        if max_parse_attempts < 1:
            raise ValueError(f"max_parse_attempts must be >= 1, got {max_parse_attempts}")
        if mcts_simulations is not None and mcts_simulations < 1:
            raise ValueError(f"mcts_simulations must be >= 1 or None (the spec's budgets), got {mcts_simulations}")
        self.observation_format = observation_format
        self.max_parse_attempts = max_parse_attempts
        self.mcts_simulations = mcts_simulations
        self._rng = random.Random(seed)  # draws the task ids and seeds that callers leave out
        self._episodes: dict[str, Episode] = {}
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
        decoded = decode_task_id(task_id)
        game_name, params = decoded["game_name"], decoded["game_params"]
        if not is_playable(task_id):
            info = self._blank_info() | {
                "task_id": task_id, "seed": seed, "game_name": game_name, "opponent_type": opponent,
                "score": 0.0, "success": False,
                "error": _error("invalid_game", f"task {task_id} asks for {game_name} with parameters {params}, "
                                "which open_spiel cannot load; use a task id for which is_playable() is True"),
            }
            return step_result(f"Error: task {task_id} ({game_name} {params}) cannot be played.",
                               done=True, truncated=True, info=info)
        game = _load_game(game_name, tuple(sorted(params.items())))
        episode = Episode(game_name, game, task_id=task_id, seed=seed, opponent=opponent,
                          observation_format=self.observation_format, mcts_simulations=self.mcts_simulations)
        episode_id = uuid.uuid4().hex
        self._episodes[episode_id] = episode
        async with episode.lock:
            # Always off the loop: completing a bridge deal runs a double-dummy solver (0.5-3 s).
            reward = await asyncio.to_thread(episode.advance)
            if episode.done:  # the other seats ended the game before the model's first decision
                return self._after_move(episode_id, episode, own=0.0, others=reward)
            if self.observation_format == "evaluate":
                return self._result(episode_id, episode, episode.turn_prompt)
            episode.cumulative_reward += reward
            return self._result(episode_id, episode, text.openenv_reset_text(episode.spec.rules, episode.turn_prompt))

    async def step(self, action: str, episode_id: str) -> StepResult:
        found = self._lookup(episode_id, stepping=True)
        if not isinstance(found, Episode):
            return found
        episode = found
        action = "" if action is None else str(action)
        async with episode.lock:
            if episode.done:  # a concurrent step finished it while this one waited
                return self._lookup(episode_id, stepping=True)
            if self.observation_format == "evaluate":
                chosen = text.parse_evaluate_action(text.strip_think(action), episode.legal, episode.labels)
            else:
                chosen = text.parse_openenv_action(action, episode.legal)
            if chosen is None:
                return self._unusable_action(episode_id, episode, action)
            # pyspiel holds the GIL, so a thread buys no parallelism, only a live event loop while a
            # search runs (seconds). Random-opponent moves take microseconds, less than a thread hop.
            if episode.has_search_bot:
                own, others = await asyncio.to_thread(episode.take_turn, chosen)
            else:
                own, others = episode.take_turn(chosen)
            return self._after_move(episode_id, episode, own, others)

    async def state(self, episode_id: str) -> StepResult:
        found = self._lookup(episode_id, stepping=False)
        if not isinstance(found, Episode):
            return found
        return self._result(episode_id, found, found.turn_prompt)

    async def stop(self, episode_id: str) -> dict[str, Any]:
        active = self._episodes.pop(episode_id, None)
        finished = self._finished.pop(episode_id, None)
        return {"status": "ok", "stopped": active is not None or finished is not None, "episode_id": episode_id}

    async def close(self) -> None:
        self._episodes.clear()
        self._finished.clear()

    def _lookup(self, episode_id: str, stepping: bool) -> Episode | StepResult:
        if not episode_id:
            return step_result("Error: no episode_id given; call reset() first.", done=True, truncated=True,
                               info=self._blank_info() | {"error": _error("no_episode_id", "episode_id is empty")})
        if episode_id in self._episodes:
            return self._episodes[episode_id]
        if episode_id in self._finished:
            final = self._finished[episode_id]
            info = dict(final["info"])
            if stepping:
                info["error"] = _error("episode_done", f"episode {episode_id} has finished; call reset()")
            return step_result(final["observation"], done=True, episode_id=episode_id, info=info)
        return step_result(
            f"Error: unknown episode {episode_id!r} (stopped, never started, or finished long ago).",
            done=True, truncated=True, episode_id=episode_id,
            info=self._blank_info() | {"error": _error("episode_not_found", f"no episode {episode_id!r}")})

    def _unusable_action(self, episode_id: str, episode: Episode, action: str) -> StepResult:
        episode.illegal_moves += 1
        if self.observation_format == "openenv":
            return self._result(
                episode_id, episode, text.openenv_invalid_text(action, episode.legal, episode.labels),
                reward=INVALID_ACTION_PENALTY, parse_error=True,
                error=_error("invalid_action", f"no legal action ID in {action[:200]!r}"))
        feedback = text.evaluate_feedback(episode.attempt, self.max_parse_attempts)
        if episode.attempt < self.max_parse_attempts:
            episode.attempt += 1
            return self._result(episode_id, episode, feedback, parse_error=True)
        episode.forfeited = True
        summary = text.evaluate_summary(episode.game_name, episode.player, None, 0.0, self.max_parse_attempts)
        return self._result(episode_id, episode, f"{feedback}\n\n{summary}", parse_error=True)

    def _after_move(self, episode_id: str, episode: Episode, own: float, others: float | None) -> StepResult:
        if self.observation_format == "evaluate":
            if not episode.done:
                return self._result(episode_id, episode, episode.turn_prompt)
            summary = text.evaluate_summary(episode.game_name, episode.player, episode.returns, episode.score,
                                            self.max_parse_attempts)
            return self._result(episode_id, episode, summary, reward=episode.score)
        # openenv rewards (spec 4.6-4.8): raw rewards until the end, then the score; the running
        # total adds the score only when the model's own move ended the game.
        if others is None:
            episode.cumulative_reward += episode.score
        else:
            episode.cumulative_reward += own + others
        if not episode.done:
            return self._result(episode_id, episode, episode.turn_prompt, reward=own + others)
        terminal = text.openenv_terminal_text(episode.game_name, episode.player, episode.returns, episode.score)
        return self._result(episode_id, episode, terminal, reward=episode.score)

    def _result(self, episode_id: str, episode: Episode, observation: str, reward: float = 0.0,
                parse_error: bool = False, error: dict[str, Any] | None = None) -> StepResult:
        info: dict[str, Any] = {
            "task_id": episode.task_id, "seed": episode.seed, "game_name": episode.game_name,
            "llm_player_id": episode.player, "opponent_type": episode.opponent,
            "system_prompt": episode.system_prompt,
            "turn_prompt": episode.turn_prompt, "parse_error": parse_error,
            "legal_actions": list(episode.legal), "illegal_moves": episode.illegal_moves,
            "turns": episode.turns, "step_count": episode.step_count,
        }
        if self.observation_format == "evaluate":
            info["attempt"] = episode.attempt
        else:
            info["cumulative_reward"] = episode.cumulative_reward
        if episode.last_opponent_action is not None:
            info["last_opponent_action"] = episode.last_opponent_action
        if error:
            info["error"] = error
        if episode.done:
            info |= {"score": episode.score, "success": episode.score > 0.5, "returns": episode.returns}
        result = step_result(observation, reward, done=episode.done, episode_id=episode_id, info=info)
        if episode.done:
            self._retire(episode_id, result)
        return result

    def _retire(self, episode_id: str, final: StepResult) -> None:
        if self._episodes.pop(episode_id, None) is None:
            return  # stopped while its last move ran
        self._finished[episode_id] = final
        while len(self._finished) > FINISHED_KEPT:
            self._finished.popitem(last=False)

    @staticmethod
    def _blank_info() -> dict[str, Any]:
        return {
            "task_id": None, "seed": None, "game_name": None, "llm_player_id": None, "opponent_type": None,
            "system_prompt": None, "turn_prompt": "", "parse_error": False, "legal_actions": [],
            "illegal_moves": 0, "turns": 0, "step_count": 0,
        }
