"""Expert players for warm-start data: they choose the model's moves in the env's own games.

- `cfr` (leduc_poker, the default): the average strategy of CFR+ (open_spiel's C++ solver) over the
  whole game, looked up by information state, so it uses only what the player sees; moves are
  sampled from it (it is a mixed strategy).
- `best_response` (leduc_poker): the best response to the validators' MCTS opponent itself
  (opponent_model.py): an equilibrium strategy guards against bluffs that an opponent who sees
  every card never needs, this one exploits how that opponent actually plays.
- `mcts` (sequential games with an MCTS opponent in the env): the env's MCTS opponent in the implementation
  the game table allows (open_spiel's C++ search where `GameSpec.fast_search`, else the exact one: gin_rummy),
  random rollouts, on the true state like the opponent, at a configurable number of simulations.
- `true_bids` (liars_dice): aimed at an opponent that sees every die, which answers a bid by raising
  to the highest bid that holds (nothing true is left above it) and calls Liar on a false one. So a
  raise wins only if it is itself the highest bid that holds: over the opponent hands under which
  its bids hold (it bids false only when no true raise is left), it takes the bid most likely to be
  that, or Liar when the standing bid is more likely to fail (`true_bid_choice`).
- `count_bids` (liars_dice): `true_bids` cut to what a small model can work out in a few written steps
  (`counting_bid`): its first bid, in either seat, is the commonest face of its dice at two more than it
  holds (raised above a standing bid), `true_bids`' opening on 249 of the 252 hands and a tie of it on
  the other 3; every later turn it calls Liar, since against that opponent a raise over its bid is
  false exactly when its bid was the highest that holds, and otherwise the game is lost whatever it does.
- `simple_gin` (gin_rummy): open_spiel's SimpleGinRummyBot, a rule player that knocks as soon as it
  may, takes the upcard when it completes a meld and discards its highest deadwood; microseconds a
  move, where a search of gin_rummy costs seconds.
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
import itertools
import math
import re

import numpy as np
import pyspiel

from ppo_affine.config import DEFAULT_CACHE_DIR
from ppo_affine import opponent_model
from ppo_affine.envs.games import GAMES
from ppo_affine.envs.openspiel_episode import mcts_bot, search_used

KINDS = ("cfr", "best_response", "mcts", "true_bids", "count_bids", "montecarlo", "prize", "simple_gin")
# game -> the experts that play it, the default first; other games with an MCTS opponent: ("mcts",)
CHOICES = {
    "leduc_poker": ("cfr", "best_response"),
    "liars_dice": ("mcts", "true_bids", "count_bids"),
    "goofspiel": ("prize", "montecarlo"),
    "gin_rummy": ("simple_gin", "mcts"),
}
# teachers built to beat the validators' MCTS opponent (it sees every card and die): against another they play
# their answer to a player who is not there
AIMED_AT_MCTS = frozenset({"best_response", "true_bids", "count_bids"})
GOOFSPIEL_EXPERTS = CHOICES["goofspiel"]
DEFAULT_GOOFSPIEL_EXPERT = GOOFSPIEL_EXPERTS[0]
OPPONENT_MODEL_SAMPLES = 32  # searches per state behind the best response (opponent_model.py)
_PRIZE_CARD = re.compile(r"Current point card: (\d+)")


class ExpertUnavailable(ValueError):
    """No expert plays this game."""


def expert_choices(game_name: str) -> tuple[str, ...]:
    """The experts that play `game_name`, the default first; () when none does."""
    return CHOICES.get(game_name, ("mcts",) if GAMES[game_name].mcts is not None else ())


def expert_kind(game_name: str, chosen: dict[str, str] | None = None) -> str:
    """Which expert plays `game_name`: `chosen[game_name]` if given, else the game's default;
    ExpertUnavailable when no expert plays it or the choice is not one of its experts."""
    if game_name not in GAMES:
        raise ExpertUnavailable(f"unknown game {game_name!r}; expected one of {list(GAMES)}")
    choices = expert_choices(game_name)
    if not choices:
        with_experts = [g for g in GAMES if expert_choices(g)]
        raise ExpertUnavailable(f"no expert plays {game_name} (it has no MCTS opponent to imitate); "
                                f"games with experts: {with_experts}")
    kind = (chosen or {}).get(game_name, choices[0])
    if kind not in choices:
        raise ExpertUnavailable(f"unknown {game_name} expert {kind!r}; expected one of {choices}")
    return kind


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

    def __init__(self, kind: str, game: pyspiel.Game, player: int, seed: int, budget: int, cfr_iterations: int,
                 cache_dir: str = DEFAULT_CACHE_DIR, opponent_simulations: int | None = None):
        """`opponent_simulations`: the MCTS opponent's simulations when not the game's validator budget
        (the best response answers the opponent it will meet)."""
        self.kind, self.game, self.player = kind, game, player
        self.rng = np.random.RandomState(seed % 2**32)
        self.budget = budget
        if kind == "cfr":
            self.policy = cfr_policy(str(game), cfr_iterations)
        elif kind == "best_response":
            simulations, n_rollouts = GAMES[game.get_type().short_name].mcts
            opponent_budget = (opponent_simulations or simulations, n_rollouts)
            model = opponent_model.load_or_build(str(game), opponent_budget, OPPONENT_MODEL_SAMPLES, cache_dir)
            self.responses = model["best_response"][player]
        elif kind == "mcts":
            spec = GAMES[game.get_type().short_name]
            # the C++ search only where the game table allows it (gin_rummy's C++ rollouts crash the process)
            self.bot = mcts_bot(game, (budget, spec.mcts[1]), seed + 1, seed, search_used(spec, "fast"))
        elif kind == "simple_gin":
            self.bot = pyspiel.make_simple_gin_rummy_bot(game.get_parameters(), player)

    def choose(self, state: pyspiel.State, labels: dict[int, str]) -> tuple[int, str]:
        if self.kind == "cfr":
            actions, probs = zip(*self.policy[state.information_state_string(self.player)])
            probs = np.asarray(probs) / sum(probs)
            action = int(actions[self.rng.choice(len(actions), p=probs)])
            best = int(actions[int(np.argmax(probs))])
            if action == best:
                return action, f"The equilibrium strategy mostly plays {labels[action]} here."
            return action, f"The equilibrium strategy mixes in {labels[action]} here to stay unpredictable."
        if self.kind == "best_response":
            action = self.responses[state.information_state_string(self.player)]
            return action, f"Against this opponent, {labels[action]} pays best here."
        if self.kind == "mcts":
            action = int(self.bot.step(state))
            return action, f"Searching ahead, {labels[action]} leads to the best outcomes."
        if self.kind == "true_bids":
            return self._true_bid(state, labels)
        if self.kind == "count_bids":
            dice, bids = self._dice_and_bids(state)
            if len(bids) >= 2:  # our own bid stands in the history
                return LIAR, "my bid is made: Liar"
            return counting_bid(dice, bids[0] if bids else None)
        if self.kind == "simple_gin":
            action = int(self.bot.step(state))
            return action, f"I keep my melds and shed deadwood: {labels[action]}."
        if self.kind == "prize":
            return self._prize_bid(state)
        return self._best_bid(state, labels)

    def _dice_and_bids(self, state: pyspiel.State) -> tuple[list[int], list[tuple[int, int]]]:
        """liars_dice: our dice and the bids so far as (quantity, face), from our information state."""
        dice, *history = state.information_state_string(self.player).split()
        return [int(d) for d in dice], [tuple(map(int, bid.split("-"))) for bid in history]

    def _true_bid(self, state: pyspiel.State, labels: dict[int, str]) -> tuple[int, str]:
        dice, bids = self._dice_and_bids(state)
        action, chance = true_bid_choice(dice, bids, state.legal_actions(self.player))
        if action == LIAR:
            quantity, face = bids[-1]
            return action, f"Given my dice, the bid {quantity}-{face} fails with probability {chance:.2f}: Liar."
        return action, f"Given my dice, {labels[action]} is the highest bid that holds with probability {chance:.2f}."

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


LIAR = 60  # liars_dice's challenge action; bid (q, f) is action (q - 1) * 6 + f - 1


def bid_action(quantity: int, face: int) -> int:
    """liars_dice's action ID for the bid 'quantity-face' (faces 1-6)."""
    return (quantity - 1) * 6 + face - 1


def action_bid(action: int) -> tuple[int, int]:
    """The bid (quantity, face) that liars_dice's action ID names."""
    return action // 6 + 1, action % 6 + 1


@functools.lru_cache(maxsize=None)
def dice_compositions(dice: int, sides: int) -> tuple[np.ndarray, np.ndarray]:
    """Every multiset of `dice` dice as face counts [K, sides] with its probability [K]."""
    counts, probabilities = [], []
    for faces in itertools.combinations_with_replacement(range(sides), dice):
        count = np.bincount(faces, minlength=sides)
        counts.append(count)
        probabilities.append(math.factorial(dice) / np.prod([math.factorial(c) for c in count]) / sides**dice)
    return np.array(counts), np.array(probabilities)


def _matching(counts: np.ndarray, face: int) -> np.ndarray:
    """Dice that count for `face` (1-based): that face, plus sixes (wild) for faces below 6."""
    return counts[..., face - 1] + (counts[..., 5] if face < 6 else 0)


def true_bid_totals(mine: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For our face counts `mine` [6] and each opponent hand in `counts` [K, 6]: the dice that count for
    each face [K, 6], and the highest bid that holds as an action id [K]: (q - 1) * 6 + f - 1 with q = totals[f]."""
    totals = np.stack([_matching(mine, face) + _matching(counts, face) for face in range(1, 7)], axis=1)
    return totals, np.max(np.where(totals > 0, (totals - 1) * 6 + np.arange(6), -1), axis=1)


def highest_true_bid(dice: list[int], other_dice: list[int]) -> int:
    """The highest bid that holds over both hands, as an action id."""
    counts = [np.bincount(np.array(hand) - 1, minlength=6) for hand in (dice, other_dice)]
    return int(true_bid_totals(counts[0], counts[1][None])[1][0])


# Weight of an opponent hand under which the opponent's bid breaks the model below (a true raise was left
# but it bid false, or the reverse): the real MCTS is a noisy search, so such hands keep a little weight.
# 600 paired second-seat games against the validators' MCTS (a scratch harness): 0.198 at 0.002, 0.200 at
# 0.02, 0.172 at 0.1; at 0.01, bench/teacher_score.py's 200 second-seat games: 0.220.
OFF_MODEL_WEIGHT = 0.01


def opponent_hand_posterior(my_dice: list[int], bids: list[tuple[int, int]]
                            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Over the opponent's possible hands, given our dice and the bids so far (alternating seats, the last
    one the opponent's when any): each hand's dice per face [K, 6], highest bid that holds [K] and
    probability [K]. The opponent sees every die, so it bids true whenever a true raise is left: its
    opening always, its answer to a bid of ours below the highest bid that holds always; only over our
    bid that is itself the highest true one is its raise false. Measured: the validators' MCTS opened
    with a true bid in 400 of 400 deals."""
    mine = np.bincount(np.array(my_dice) - 1, minlength=6)
    counts, weights = dice_compositions(len(my_dice), 6)
    totals, highest = true_bid_totals(mine, counts)
    actions = [bid_action(quantity, face) for quantity, face in bids]
    for i in range(len(bids) - 1, -1, -2):  # the opponent's bids, the last first
        quantity, face = bids[i]
        holds = totals[:, face - 1] >= quantity
        true_raise_left = np.ones_like(holds) if i == 0 else actions[i - 1] < highest
        weights = weights * np.where(holds == true_raise_left, 1.0, OFF_MODEL_WEIGHT)
    return totals, highest, weights / weights.sum()


def counting_steps(hand: list[int], face: int) -> list[str]:
    """The counts a bid on `face` rests on, read off the sorted dice line: the sixes, each other face's
    count, then the face with the sixes added, e.g. [1, 3, 3, 6, 6], 3 -> ['6s: 2', '1s: 1', '3s: 2',
    'best 3s: 2+2=4']."""
    sixes = hand.count(6)
    steps = [f"6s: {sixes}"] + [f"{f}s: {hand.count(f)}" for f in sorted(set(hand) - {6})]
    held = f"{sixes}" if face == 6 else f"{hand.count(face)}+{sixes}={hand.count(face) + sixes}"
    return [*steps, f"best {face}s: {held}"]


def bid_label(action: int, id_steps: bool) -> str:
    """'bid q-f' for a bid action, with `id_steps` its ID counted up from the quantity's first face
    ('bid 6-3: 6-1 30, 6-2 31, 6-3 32'): the prompt lists 'ID -> label', which a student would
    otherwise have to read backwards."""
    quantity, face = action_bid(action)
    label = f"bid {quantity}-{face}"
    if id_steps:
        label += ": " + ", ".join(f"{quantity}-{f} {action - face + f}" for f in range(1, face + 1))
    return label


def counting_bid(hand: list[int], standing: tuple[int, int] | None = None, id_steps: bool = True) -> tuple[int, str]:
    """`count_bids`' bid and the steps that reach it (`counting_steps`): the commonest face other than six
    (the highest of a tie; five when every die is a six) at two more than the dice that count for it,
    raised above a standing bid (quantity, face) to the lowest quantity that ranks above it, e.g.
    [1, 3, 3, 6, 6] -> '6s: 2; 1s: 1; 3s: 2; best 3s: 2+2=4; bid 6-3: 6-1 30, 6-2 31, 6-3 32' (action 32),
    or over '6-4': '...; best 3s: 2+2=4; 6-3 not above 6-4; bid 7-3: 7-1 36, ...'. Opening, it wins against
    an opponent that sees every die exactly as often as `true_bid_choice`'s opening, for every hand of
    five (the same bid but for three ties). Liar when no bid is left above the standing one."""
    hand = sorted(hand)
    face = max((f for f in range(1, 6) if f in hand), key=lambda f: (hand.count(f), f), default=5)
    steps = counting_steps(hand, face)
    quantity = hand.count(face) + hand.count(6) + 2
    if standing is not None and (quantity, face) <= standing:  # bids rank by quantity, then face
        steps.append(f"{quantity}-{face} not above {standing[0]}-{standing[1]}")
        quantity = standing[0] + (face <= standing[1])
    action = bid_action(quantity, face)
    if action >= LIAR:
        return LIAR, "; ".join([*steps, "none left: Liar"])
    return action, "; ".join([*steps, bid_label(action, id_steps)])


def true_bid_choice(my_dice: list[int], bids: list[tuple[int, int]], legal: list[int]) -> tuple[int, float]:
    """liars_dice against an opponent that sees every die: it raises to the highest bid that holds,
    which leaves no true raise, so a raise wins only if it is itself the highest bid that holds, and a
    challenge only if the standing bid fails. Over the opponent's possible hands weighted by how such an
    opponent would have bid (`opponent_hand_posterior`), take the action most likely to win; returns it
    with that probability."""
    totals, highest, weights = opponent_hand_posterior(my_dice, bids)
    p_challenge = 0.0
    if bids:
        quantity, face = bids[-1]
        p_challenge = float(weights @ (totals[:, face - 1] < quantity))
    p_win = {a: float(weights[highest == a].sum()) for a in legal if a != LIAR}
    best = max(p_win, key=lambda a: (p_win[a], -a), default=None)
    if LIAR in legal and (best is None or p_challenge >= p_win[best]):
        return LIAR, p_challenge
    return best, p_win[best]
