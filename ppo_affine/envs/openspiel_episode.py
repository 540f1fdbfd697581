"""One Affine OpenSpiel game, synchronous: the pyspiel state, the bots in the other seats, and the
protocol of one observation format (texts, parsing, attempts, rewards, scores).

Protocol: docs/protocols.md, 'The game env (Affine OpenSpiel)'. `evaluate` replays the validators' evaluate() game
turn by turn: LLM seat (seed % 2) % n, one bot per other seat (random on RandomState(seed+4+p);
MCTS rollouts on seed+5+p, tree on seed+6+p), chance from RandomState(seed), joint moves at
simultaneous nodes, the three-rule parser after think-tag stripping, and a lost game after 3
unusable replies to one decision. `openenv` is the reset/step protocol: seat seed % n, one set of
bot streams (seed+2 random, seed+3/+4 MCTS), chance from RandomState(seed+100), first-digit-run
parser, -0.01 per unusable action and no attempt limit.

The MCTS opponent comes in two implementations of one algorithm (UCT c 1.414, solver on, the
per-game budgets, random-rollout leaf values, a search of the true state): `exact` is the Affine
env's own Python search with its rollout evaluator, draw for draw the validators' opponent; `fast`
is open_spiel's C++ `MCTSBot` + `RandomRolloutEvaluator` with the same settings, tens of times faster
(bench/opponent_speed.py) and shown to play the same games to within sampling error
(bench/opponent_parity.py). The two differ only in their random streams: the C++ rollouts sample
chance outcomes by their probabilities where the Affine ones pick uniformly among them, which is the
same draw in every game with an MCTS opponent (their chance outcomes are uniform where a search can
reach them). `fast` applies to the games whose parity run held (`GameSpec.fast_search`); the others
keep the exact search. The C++ search releases the GIL, so concurrent episodes' searches run in
parallel even on threads; the exact one needs worker processes for that (openspiel_env.py).

Where the real env crashes this plays on correctly: a blackjack ten counts 10 (games.py), 4-player
openenv games with the random opponent pick moves for the seat to move, goofspiel in openenv shows
the legal cards and plays the joint move as chosen. Seeds are reduced mod 2**32 after their offsets.
"""
from __future__ import annotations

import functools
import hashlib
import inspect
import time
from typing import Any

import numpy as np
from numpy.random.bit_generator import ISeedSequence
import pyspiel
from open_spiel.python.algorithms import mcts
from open_spiel.python.bots.uniform_random import UniformRandomBot

from ppo_affine.envs import openspiel_text as text
from ppo_affine.envs.base import StepResult, step_result
from ppo_affine.envs.games import GAMES, GameSpec, decode_task_id, describe_default
from ppo_affine.envs.opponent_moves import OpponentMoves, move_key

SEED_SPACE = 2**32
UCT_C = 1.414
SEARCHES = ("fast", "exact")
# The C++ search prunes its tree past this size; the validators' budgets stay far below it (liars_dice
# at 3 000 simulations grows about 15 MB), so it never changes a move.
SEARCH_TREE_MB = 2048
INVALID_ACTION_PENALTY = -0.01  # openenv format only


@functools.lru_cache(maxsize=None)
def load_game(game_name: str, params: tuple[tuple[str, Any], ...]) -> pyspiel.Game:
    """The pyspiel game for decoded parameters, with Affine's misspelt names repaired."""
    renamed = GAMES[game_name].renamed_params
    return pyspiel.load_game(game_name, {renamed.get(k, k): v for k, v in params})


def model_seat(num_players: int, seed: int, observation_format: str) -> int:
    """The model's seat: (seed % 2) % players in the evaluate format, seed % players in openenv."""
    return (seed % 2) % num_players if observation_format == "evaluate" else seed % num_players


def episode_seat(task_id: int, seed: int, observation_format: str) -> int:
    """The model's seat in the episode of `task_id` and `seed` (the game is loaded once per variant)."""
    decoded = decode_task_id(task_id)
    game = load_game(decoded["game_name"], tuple(sorted(decoded["game_params"].items())))
    return model_seat(game.num_players(), seed, observation_format)


def compute_score(returns: list[float], player: int, zero_sum: bool, min_utility: float,
                  max_utility: float) -> float:
    """Affine's score in [0, 1] (docs/protocols.md, 'Scores'): min/max normalisation for zero-sum and 1-player
    games, place among the players for general-sum games of 3+, else win/draw/loss."""
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
    uniformly among `legal_actions()` at every node, chance nodes included, and stop at a non-terminal
    state without legal actions (a rare gin_rummy state) with its current returns; uniform priors."""

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
                if not actions:
                    break
                # Same draw as rng.choice(actions) from the same stream, at a fifth of the cost.
                playout.apply_action(actions[self._rng.randint(len(actions))])
            total += playout.returns()
        return total / self.n_rollouts

    def prior(self, state: pyspiel.State) -> list[tuple[int, float]]:
        actions = state.legal_actions()
        return [(action, 1.0 / len(actions)) for action in actions]


class _Unhashed(ISeedSequence):
    """MT19937's first state without hashing any entropy: `_rng` reseeds it at once."""

    def generate_state(self, n_words: int, dtype=np.uint32) -> np.ndarray:
        return np.zeros(n_words, dtype=dtype)


def _rng(seed: int) -> np.random.RandomState:
    """`np.random.RandomState(seed)`, draw for draw. RandomState(seed) first seeds its generator from hashed OS
    entropy and then overwrites that state with the legacy seeding; skipping the first (~0.1 ms, 1-3 generators an
    episode) is a fifth of leduc_poker's host time per model turn."""
    generator = np.random.RandomState(np.random.MT19937(_Unhashed()))
    generator.seed(seed % SEED_SPACE)
    return generator


def mcts_bot(game: pyspiel.Game, budget: tuple[int, int], rollout_seed: int, search_seed: int,
             search: str) -> pyspiel.Bot:
    """The validators' MCTS opponent with (max_simulations, n_rollouts) = `budget`, in either implementation."""
    max_simulations, n_rollouts = budget
    if search == "fast":
        # The C++ generators take a signed 32-bit seed.
        evaluator = pyspiel.RandomRolloutEvaluator(n_rollouts, rollout_seed % 2**31)
        return pyspiel.MCTSBot(game, evaluator, UCT_C, max_simulations, SEARCH_TREE_MB, True, search_seed % 2**31,
                               False)
    evaluator = AffineRolloutEvaluator(n_rollouts, _rng(rollout_seed))
    return mcts.MCTSBot(game, UCT_C, max_simulations, evaluator, random_state=_rng(search_seed))


def is_search_bot(bot: pyspiel.Bot) -> bool:
    return isinstance(bot, (mcts.MCTSBot, pyspiel.MCTSBot))


def has_search_opponent(game: pyspiel.Game, spec: GameSpec) -> bool:
    """Whether `opponent: mcts` gets an MCTS bot (docs/protocols.md, 'The opponents'): only games with an
    MCTS budget and no simultaneous moves, which MCTS cannot search; all others play a uniform random
    opponent."""
    return spec.mcts is not None and game.get_type().dynamics != pyspiel.GameType.Dynamics.SIMULTANEOUS


def search_budget(game: pyspiel.Game, spec: GameSpec, opponent: str, mcts_simulations: int | None
                  ) -> tuple[int, int] | None:
    """(max_simulations, n_rollouts) of the MCTS opponent this game gets, or None for a random one."""
    if opponent == "mcts" and has_search_opponent(game, spec):
        return (mcts_simulations or spec.mcts[0], spec.mcts[1])
    return None


def search_used(spec: GameSpec, search: str) -> str:
    """The implementation that plays: `fast` only where its parity run held."""
    return search if spec.fast_search else "exact"


@functools.lru_cache(maxsize=None)
def search_identity(search: str) -> str:
    """What fixes a seeded search's moves besides the game, seed, seat, budget and history: its implementation, its
    settings and a digest of the code that seeds, builds and runs it. Recorded opponent moves are keyed by it, so
    that a changed search never replays another's moves."""
    code = "".join(inspect.getsource(part) for part in (_rng, mcts_bot, build_bots, AffineRolloutEvaluator))
    return f"{search} uct_c={UCT_C} tree_mb={SEARCH_TREE_MB} code={hashlib.sha256(code.encode()).hexdigest()[:16]}"


def build_bots(game: pyspiel.Game, spec: GameSpec, observation_format: str, player: int, seed: int,
               opponent: str, mcts_simulations: int | None, search: str = "fast") -> dict[int, pyspiel.Bot]:
    """A bot for every seat but the model's (docs/protocols.md, 'The opponents'); empty for 1-player games.
    `search="fast"` takes the C++ search for the games where it is proven the same (`spec.fast_search`)."""
    if search not in SEARCHES:
        raise ValueError(f"opponent search must be one of {SEARCHES}, got {search!r}")
    seats = [p for p in range(game.num_players()) if p != player]
    budget = search_budget(game, spec, opponent, mcts_simulations)
    search = search_used(spec, search)
    if observation_format == "evaluate":
        if budget:
            return {p: mcts_bot(game, budget, seed + 5 + p, seed + 6 + p, search) for p in seats}
        return {p: UniformRandomBot(p, _rng(seed + 4 + p)) for p in seats}
    # openenv: one bot's random streams serve every other seat. Affine's single random bot asks
    # for player 0's legal actions whoever is to move, which crashes 4-player games; sharing
    # the stream between per-seat bots keeps its draws and plays legal moves.
    if budget:
        bot = mcts_bot(game, budget, seed + 3, seed + 4, search)
        return {p: bot for p in seats}
    stream = _rng(seed + 2)
    return {p: UniformRandomBot(p, stream) for p in seats}


def _label(state: pyspiel.State, player: int, action: int) -> str:
    try:
        return state.action_to_string(player, action)
    except pyspiel.SpielError:
        return str(action)


def _error(kind: str, message: str, retryable: bool = False) -> dict[str, Any]:
    return {"type": kind, "message": message, "retryable": retryable}


class Episode:
    """One game from reset to its final score; `start`, `step` and `observe` return StepResults."""

    def __init__(self, episode_id: str, *, task_id: int, seed: int, opponent: str, observation_format: str,
                 max_parse_attempts: int, mcts_simulations: int | dict[str, int] | None, opponent_search: str = "fast",
                 opponent_moves: str | None = None):
        decoded = decode_task_id(task_id)
        self.episode_id, self.task_id, self.seed, self.opponent = episode_id, task_id, seed, opponent
        self.game_name, self.format = decoded["game_name"], observation_format
        self.max_parse_attempts = max_parse_attempts
        self.spec = GAMES[self.game_name]
        self.game = load_game(self.game_name, tuple(sorted(decoded["game_params"].items())))
        evaluate = observation_format == "evaluate"
        self.player = model_seat(self.game.num_players(), seed, observation_format)
        if isinstance(mcts_simulations, dict):  # per-game budgets; games not named keep the validators'
            mcts_simulations = mcts_simulations.get(self.game_name)
        self.bots = build_bots(self.game, self.spec, observation_format, self.player, seed, opponent, mcts_simulations,
                               opponent_search)
        self.has_search_bot = any(is_search_bot(bot) for bot in self.bots.values())
        # Recorded opponent moves (opponent_moves.py): what fixes a search's move besides the history.
        self.move_log = OpponentMoves(opponent_moves) if opponent_moves and self.has_search_bot else None
        self._move_key_fields = dict(
            game=self.game_name, params=decoded["game_params"], seed=seed, observation_format=observation_format,
            budget=search_budget(self.game, self.spec, opponent, mcts_simulations),
            search=search_identity(search_used(self.spec, opponent_search)))
        self._skipped_searches: list[tuple[pyspiel.Bot, pyspiel.State]] = []
        self.opponent_moves_replayed = 0
        self.chance_rng = _rng(seed if evaluate else seed + 100)
        # openenv puts the rules in the first observation instead of a system message.
        self.system_prompt = text.system_prompt(self.game_name, self.spec.rules) if evaluate else None
        self.state = self.game.new_initial_state()
        self.step_count = 0  # applied player moves, model and opponents (a joint move counts once)
        self.turns = 0  # model decisions applied
        self.illegal_moves = 0
        self.attempt = 1  # evaluate format: which reply to the pending decision comes next
        self.cumulative_reward = 0.0  # openenv bookkeeping, mirrors the real env's mix
        self.last_opponent_action: int | None = None
        self.opponent_seconds = 0.0  # wall time the other seats' bots spent choosing moves
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
        zero_sum = self.game.get_type().utility == pyspiel.GameType.Utility.ZERO_SUM
        return compute_score(self.state.returns(), self.player, zero_sum, self.game.min_utility(),
                             self.game.max_utility())

    def start(self) -> StepResult:
        """Play up to the model's first decision; the reset result."""
        reward = self._advance()
        if self.done:  # the other seats ended the game before the model's first decision
            return self._after_move(own=0.0, others=reward)
        if self.format == "evaluate":
            return self._result(self.turn_prompt)
        self.cumulative_reward += reward
        return self._result(text.openenv_reset_text(self.spec.rules, self.turn_prompt))

    def step(self, action: str | None) -> StepResult:
        """Parse the model's reply; apply it and play on, or report why it was unusable."""
        action = "" if action is None else str(action)
        if self.format == "evaluate":
            chosen = text.parse_evaluate_action(text.strip_think(action), self.legal, self.labels)
        else:
            chosen = text.parse_openenv_action(action, self.legal)
        if chosen is None:
            return self._unusable_action(action)
        own, others = self._take_turn(chosen)
        return self._after_move(own, others)

    def observe(self) -> StepResult:
        """The pending decision's prompt, without side effects (the state() call)."""
        return self._result(self.turn_prompt)

    def _advance(self) -> float:
        """Play chance nodes and the other seats until the model must decide or the game ends;
        returns the model's raw rewards collected on the way (non-zero only in 2048 and solitaire)."""
        state, reward = self.state, 0.0
        while not state.is_terminal():
            if state.is_chance_node():
                outcomes, probs = zip(*state.chance_outcomes())
                state.apply_action(int(self.chance_rng.choice(outcomes, p=probs)))
                continue
            # Goofspiel, the one simultaneous game, deals both players a card at every such node.
            if state.is_simultaneous_node() or state.current_player() == self.player:
                break
            action = self._bot_move(state.current_player())
            state.apply_action(action)
            self.step_count += 1
            self.last_opponent_action = action
            reward += state.rewards()[self.player]
        self._prepare_decision()
        return reward

    def _take_turn(self, action: int) -> tuple[float, float | None]:
        """Apply the model's legal action, then advance. Returns (the model's raw reward for its move,
        the rewards collected while advancing, or None when the model's move ended the game)."""
        state = self.state
        if state.is_simultaneous_node():
            state.apply_actions([
                action if p == self.player
                else self._bot_move(p) if state.legal_actions(p) else pyspiel.INVALID_ACTION
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
        return own, self._advance()

    def _bot_move(self, seat: int) -> int:
        started = time.perf_counter()
        bot = self.bots[seat]
        key = None
        if self.move_log is not None:
            key = move_key(seat=seat, history=self.state.history(), **self._move_key_fields)
            recorded = self.move_log.get(key, self.state.legal_actions(seat))
            if recorded is not None:
                # the search this skips would have drawn from the bot's streams: run it before the next real one
                self._skipped_searches.append((bot, self.state.clone()))
                self.opponent_moves_replayed += 1
                self.opponent_seconds += time.perf_counter() - started
                return recorded
            for skipped_bot, state in self._skipped_searches:
                skipped_bot.step(state)
            self._skipped_searches.clear()
        action = int(bot.step(self.state))
        if key is not None:
            self.move_log.put(key, action)
        self.opponent_seconds += time.perf_counter() - started
        return action

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

    def _unusable_action(self, action: str) -> StepResult:
        self.illegal_moves += 1
        if self.format == "openenv":
            return self._result(
                text.openenv_invalid_text(action, self.legal, self.labels), reward=INVALID_ACTION_PENALTY,
                parse_error=True, error=_error("invalid_action", f"no legal action ID in {action[:200]!r}"))
        feedback = text.evaluate_feedback(self.attempt, self.max_parse_attempts)
        if self.attempt < self.max_parse_attempts:
            self.attempt += 1
            return self._result(feedback, parse_error=True)
        self.forfeited = True
        self._prepare_decision()
        summary = text.evaluate_summary(self.game_name, self.player, None, 0.0, self.max_parse_attempts)
        return self._result(f"{feedback}\n\n{summary}", parse_error=True)

    def _after_move(self, own: float, others: float | None) -> StepResult:
        if self.format == "evaluate":
            if not self.done:
                return self._result(self.turn_prompt)
            summary = text.evaluate_summary(self.game_name, self.player, self.returns, self.score,
                                            self.max_parse_attempts)
            return self._result(summary, reward=self.score)
        # openenv rewards (docs/protocols.md, 'The reset/step protocol'): raw rewards until the end, then
        # the score; the running total adds the score only when the model's own move ended the game.
        if others is None:
            self.cumulative_reward += self.score
        else:
            self.cumulative_reward += own + others
        if not self.done:
            return self._result(self.turn_prompt, reward=own + others)
        terminal = text.openenv_terminal_text(self.game_name, self.player, self.returns, self.score)
        return self._result(terminal, reward=self.score)

    def _result(self, observation: str, reward: float = 0.0, parse_error: bool = False,
                error: dict[str, Any] | None = None) -> StepResult:
        info: dict[str, Any] = {
            "task_id": self.task_id, "seed": self.seed, "game_name": self.game_name,
            "llm_player_id": self.player, "opponent_type": self.opponent, "system_prompt": self.system_prompt,
            "turn_prompt": self.turn_prompt, "parse_error": parse_error, "legal_actions": list(self.legal),
            "illegal_moves": self.illegal_moves, "turns": self.turns, "step_count": self.step_count,
            "opponent_seconds": round(self.opponent_seconds, 6),
        }
        if self.format == "evaluate":
            info["attempt"] = self.attempt
        else:
            info["cumulative_reward"] = self.cumulative_reward
        if self.last_opponent_action is not None:
            info["last_opponent_action"] = self.last_opponent_action
        if error:
            info["error"] = error
        if self.done:
            info |= {"score": self.score, "success": self.score > 0.5, "returns": self.returns}
        return step_result(observation, reward, done=self.done, episode_id=self.episode_id, info=info)
