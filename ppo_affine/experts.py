"""Expert players for warm-start data: they choose the model's moves in the env's own games.

- `cfr` (leduc_poker): the average strategy of CFR+ (open_spiel's C++ solver) over the whole
  game, looked up by information state, so it uses only what the player sees; moves are sampled
  from it (it is a mixed strategy).
- `mcts` (sequential games with an MCTS opponent in the env): open_spiel's MCTS with the env's
  random-rollout evaluator, on the true state like the env's own MCTS opponent, at a
  configurable number of simulations.
- `prize` (goofspiel, the default): bid the card equal to the prize card. Against the validators'
  random opponent it scores 0.93-0.98 over the N = 8..16 variants (as high as `montecarlo`), it is
  always legal (prizes and bids are used up in step) and it is a function of one line of the
  observation, far easier to imitate than a search.
- `montecarlo` (goofspiel, optional): every legal bid is scored by random playouts in which the
  opponent bids at random, and the best is taken (MCTS cannot search simultaneous moves).

`choose` returns the move and a one-sentence reason (for `<think>` replies; the env strips those).
"""
from __future__ import annotations

import functools
import re

import numpy as np
import pyspiel
from open_spiel.python.algorithms import mcts

from ppo_affine.envs.games import GAMES
from ppo_affine.envs.openspiel_episode import UCT_C, AffineRolloutEvaluator

KINDS = ("cfr", "mcts", "montecarlo", "prize")
CFR_GAMES = ("leduc_poker",)
GOOFSPIEL_EXPERTS = ("prize", "montecarlo")
DEFAULT_GOOFSPIEL_EXPERT = "prize"
_PRIZE_CARD = re.compile(r"Current point card: (\d+)")


class ExpertUnavailable(ValueError):
    """No expert plays this game."""


def expert_kind(game_name: str, goofspiel_expert: str = DEFAULT_GOOFSPIEL_EXPERT) -> str:
    """Which expert plays `game_name`; ExpertUnavailable when none does."""
    if game_name not in GAMES:
        raise ExpertUnavailable(f"unknown game {game_name!r}; expected one of {list(GAMES)}")
    if goofspiel_expert not in GOOFSPIEL_EXPERTS:
        raise ExpertUnavailable(f"unknown goofspiel expert {goofspiel_expert!r}; expected one of {GOOFSPIEL_EXPERTS}")
    kind = _kind(game_name, goofspiel_expert)
    if kind is None:
        with_experts = [g for g in GAMES if _kind(g)]
        raise ExpertUnavailable(f"no expert plays {game_name} (it has no MCTS opponent to imitate); "
                                f"games with experts: {with_experts}")
    return kind


def _kind(game_name: str, goofspiel_expert: str = DEFAULT_GOOFSPIEL_EXPERT) -> str | None:
    if game_name in CFR_GAMES:
        return "cfr"
    if game_name == "goofspiel":
        return goofspiel_expert
    return "mcts" if GAMES[game_name].mcts is not None else None


@functools.lru_cache(maxsize=None)
def cfr_policy(game_string: str, iterations: int) -> dict[str, list[tuple[int, float]]]:
    """Information state -> [(action, probability)] of the CFR+ average strategy of the game
    `pyspiel.load_game(game_string)` for every player; solved once per process."""
    game = pyspiel.load_game(game_string)
    solver = pyspiel.CFRPlusSolver(game)
    for _ in range(iterations):
        solver.evaluate_and_update_policy()
    average = solver.average_policy()
    table: dict[str, list[tuple[int, float]]] = {}
    stack = [game.new_initial_state()]
    while stack:
        state = stack.pop()
        if state.is_terminal():
            continue
        if not state.is_chance_node():
            key = state.information_state_string()
            if key not in table:
                table[key] = [(int(a), float(p)) for a, p in average.get_state_policy(state)]
        stack.extend(state.child(action) for action in state.legal_actions())
    return table


class Expert:
    """One expert for one episode; its randomness comes from the episode's seed."""

    def __init__(self, kind: str, game: pyspiel.Game, player: int, seed: int, budget: int, cfr_iterations: int):
        self.kind, self.game, self.player = kind, game, player
        self.rng = np.random.RandomState(seed % 2**32)
        self.budget = budget
        if kind == "cfr":
            self.policy = cfr_policy(str(game), cfr_iterations)
        elif kind == "mcts":
            spec = GAMES[game.get_type().short_name]
            evaluator = AffineRolloutEvaluator(spec.mcts[1], np.random.RandomState((seed + 1) % 2**32))
            self.bot = mcts.MCTSBot(game, UCT_C, budget, evaluator, random_state=np.random.RandomState(seed % 2**32))

    def choose(self, state: pyspiel.State, labels: dict[int, str]) -> tuple[int, str]:
        if self.kind == "cfr":
            actions, probs = zip(*self.policy[state.information_state_string(self.player)])
            probs = np.asarray(probs) / sum(probs)
            action = int(actions[self.rng.choice(len(actions), p=probs)])
            best = int(actions[int(np.argmax(probs))])
            if action == best:
                return action, f"The equilibrium strategy mostly plays {labels[action]} here."
            return action, f"The equilibrium strategy mixes in {labels[action]} here to stay unpredictable."
        if self.kind == "mcts":
            action = int(self.bot.step(state))
            return action, f"Searching ahead, {labels[action]} leads to the best outcomes."
        if self.kind == "prize":
            return self._prize_bid(state)
        return self._best_bid(state, labels)

    def _prize_bid(self, state: pyspiel.State) -> tuple[int, str]:
        """The bid card equal to the prize card (action k bids card k+1); the nearest higher legal bid
        (else the highest) if that card is gone, which happens only when someone else chose earlier bids."""
        observation = state.observation_string(self.player)
        found = _PRIZE_CARD.search(observation)
        if found is None:
            raise ValueError(f"no 'Current point card' in the goofspiel observation: {observation!r}")
        prize = int(found.group(1))
        legal = state.legal_actions(self.player)
        action = prize - 1 if prize - 1 in legal else min((a for a in legal if a > prize - 1), default=max(legal))
        # The reason repeats the observation's own words: a small model copies "Current point card: k" from the
        # latest message by matching text (SmolLM2-135M did so in 12 of 24 full-context prompts, and in 7 of 24
        # for "The prize card is worth"), which leaves it only k -> k-1 to learn for the ID that follows.
        if action == prize - 1:
            return action, f"Current point card: {prize}"
        return action, f"Current point card: {prize}; card {prize} is gone, so I bid my card {action + 1}"

    def _best_bid(self, state: pyspiel.State, labels: dict[int, str]) -> tuple[int, str]:
        """Mean return of `budget` random playouts per legal bid, the opponent's current bid random too."""
        best, best_value = None, -np.inf
        for action in state.legal_actions(self.player):
            total = 0.0
            for _ in range(self.budget):
                playout = state.clone()
                joint = [action if p == self.player else int(self.rng.choice(playout.legal_actions(p)))
                         for p in range(self.game.num_players())]
                playout.apply_actions(joint)
                while not playout.is_terminal():
                    if playout.is_chance_node():
                        outcomes, probs = zip(*playout.chance_outcomes())
                        playout.apply_action(int(self.rng.choice(outcomes, p=probs)))
                    else:
                        playout.apply_actions([int(self.rng.choice(playout.legal_actions(p)))
                                               for p in range(self.game.num_players())])
                total += playout.returns()[self.player]
            if total > best_value:
                best, best_value = action, total
        return best, f"In simulated games, {labels[best]} wins the most points from here."
