"""The validators' MCTS opponent as data, for a game small enough to enumerate (leduc_poker): how often
it plays each action at every state where it decides, and the best response to that (the teacher
aimed at this opponent, and the ceiling of what any player scores against it).

The opponent searches the true state, so its choice depends on the agent's hidden card. open_spiel's
BestResponsePolicy asks the opponent's policy about histories (true states), not information states,
so it takes this state-dependent opponent as it is. At each state `samples` fast searches with
independent seeds estimate the distribution the env's opponent draws from (its seeds change with every
episode). Building the table costs `states x samples` searches (leduc: 3 780 x 32, minutes on two
cores), so it is cached as JSON.
"""
from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pyspiel
from open_spiel.python import policy as openspiel_policy
from open_spiel.python.algorithms.best_response import BestResponsePolicy

from ppo_affine.envs.openspiel_episode import mcts_bot

FORMAT_VERSION = 1


def decision_histories(game: pyspiel.Game) -> list[list[int]]:
    """The action history of every state where a player (not chance) decides, in a fixed order."""
    found, stack = [], [game.new_initial_state()]
    while stack:
        state = stack.pop()
        if state.is_terminal():
            continue
        if not state.is_chance_node():
            found.append(state.history())
        stack.extend(state.child(action) for action in reversed(state.legal_actions()))
    return found


def _frequencies(game_string: str, histories: list[list[int]], budget: tuple[int, int], samples: int,
                 seed: int) -> list[dict[int, float]]:
    game = pyspiel.load_game(game_string)
    table = []
    for history in histories:
        state = game.new_initial_state()
        for action in history:
            state.apply_action(action)
        # seeds unique to the state and the sample; the C++ search takes 31-bit seeds
        base = int.from_bytes(hashlib.sha256(f"{seed}:{history}".encode()).digest()[:4], "little")
        counts = Counter(int(mcts_bot(game, budget, base + 2 * k, base + 2 * k + 1, "fast").step(state))
                         for k in range(samples))
        table.append({action: count / samples for action, count in sorted(counts.items())})
    return table


def mcts_action_frequencies(game: pyspiel.Game, budget: tuple[int, int], samples: int, seed: int = 0,
                            jobs: int = 1) -> dict[str, dict[int, float]]:
    """history string -> {action: share of `samples` searches that chose it}, for every decision state."""
    histories = decision_histories(game)
    chunks = [histories[i::jobs] for i in range(jobs)]
    # spawn, not fork: an expert builds this table in a process that may hold a loaded model and its threads
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        parts = list(pool.map(_frequencies, [str(game)] * jobs, chunks, [budget] * jobs, [samples] * jobs,
                              [seed] * jobs))
    table: dict[str, dict[int, float]] = {}
    for chunk, part in zip(chunks, parts):
        for history, frequencies in zip(chunk, part):
            table[", ".join(map(str, history))] = frequencies
    return table


class SampledOpponent(openspiel_policy.Policy):
    """The opponent's policy from a frequency table, asked about true states. Every legal action keeps a
    share `floor` (spread evenly), so that each information state of the responder is reachable and gets
    an action even where no sample took the opponent there."""

    def __init__(self, game: pyspiel.Game, frequencies: dict[str, dict[int, float]], floor: float = 0.01):
        super().__init__(game, list(range(game.num_players())))
        self.frequencies, self.floor = frequencies, floor

    def action_probabilities(self, state, player_id=None):
        sampled = self.frequencies[", ".join(map(str, state.history()))]
        legal = state.legal_actions()
        return {a: (1 - self.floor) * sampled.get(a, 0.0) + self.floor / len(legal) for a in legal}


def best_response(game: pyspiel.Game, frequencies: dict[str, dict[int, float]]
                  ) -> tuple[dict[int, dict[str, int]], dict[int, float]]:
    """For each seat: information state -> the best response's action, and its expected return."""
    opponent = SampledOpponent(game, frequencies)
    actions, values = {}, {}
    for player in range(game.num_players()):
        responder = BestResponsePolicy(game, player, opponent)
        values[player] = float(responder.value(game.new_initial_state()))
        actions[player] = {infostate: int(responder.best_response_action(infostate))
                           for infostate in responder.infosets}
    return actions, values


def load_or_build(game_string: str, budget: tuple[int, int], samples: int, cache_dir: Path,
                  jobs: int = 1) -> dict:
    """{"best_response": {seat: {infostate: action}}, "values": {seat: return}, ...}, built once per setting."""
    key = hashlib.sha256(f"{FORMAT_VERSION}:{game_string}:{budget}:{samples}".encode()).hexdigest()[:12]
    path = Path(cache_dir).expanduser() / "opponent-models" / f"{key}.json"
    if path.exists():
        cached = json.loads(path.read_text())
        return {**cached, "best_response": {int(p): table for p, table in cached["best_response"].items()},
                "values": {int(p): v for p, v in cached["values"].items()}}
    game = pyspiel.load_game(game_string)
    frequencies = mcts_action_frequencies(game, budget, samples, jobs=jobs)
    actions, values = best_response(game, frequencies)
    model = {"game": game_string, "budget": list(budget), "samples": samples, "values": values,
             "best_response": actions}
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_suffix(f".tmp-{os.getpid()}")
    staging.write_text(json.dumps(model))
    os.replace(staging, path)
    return model
